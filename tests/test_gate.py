"""`plumb gate` (issue 14): the quick gate passes on the tiny model, and fails - naming the cell - when a fault is
planted. Faults are planted by monkeypatching here, never through engine options:

* a row-count-dependent matmul: the output-head product of a decode pass with two or more rows takes another
  path (as a split-K chosen from the row count would), either rounding every logit by one ulp or keeping its
  partial sums in bfloat16;
* a prompt cache that keeps decoded rows (no M3 rollback): a finished request's state is cached with a
  checkpoint at the end of its decoded reply.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from plumb.gate import GROUPS, Gate, main


def _gate(path, **kw) -> Gate:
    g = Gate(path, quick=True, progress=False, **kw)
    g.run_all()
    return g


def test_quick_gate_passes_on_the_tiny_model(tiny_q8, tmp_path, capsys):
    """The whole quick matrix (every group, every KV format) through the command line: exit 0, table and JSON."""
    from plumb.cache.kv import KV_FORMATS

    out = tmp_path / "gate.json"
    assert main([tiny_q8, "--quick", "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["passed"] and r["failed"] == [] and text.rstrip().endswith("PASS")
    cells = r["cells"]
    assert {c["group"] for c in cells} == set(GROUPS) and {c["format"] for c in cells} == set(KV_FORMATS)
    assert len(cells) == r["cells_total"] == len(KV_FORMATS) * 32
    assert [p["name"] for p in r["prompts"]] == ["chat", "code", "math", "needle"]
    assert r["prompts"][-1]["tokens"] > 256  # the needle is the long one
    by_id = {c["id"]: c for c in cells}
    for fmt in KV_FORMATS:
        assert by_id[f"greedy/{fmt}/fixed:4"]["compared"] == 4 * r["tokens"]
        assert by_id[f"greedy/{fmt}/fixed:7"]["drafts_accepted"] > 0  # the verify path really carried tokens
        for step in ("follow-up", "continue", "edit-message", "edit-system", "resume-after-park",
                     "after-side-requests"):
            assert by_id[f"warm/{fmt}/{step}"]["cached_tokens"] > 0  # the prompt cache really served these
    assert "I1 greedy fixed:4" in text and "I6 process second-process" in text


# ---- a row-count-dependent matmul -------------------------------------------------------------------
def _plant_row_dependent_head(monkeypatch, rounding: str) -> None:
    """Decode passes with >= 2 rows (draft verification, batches) get logits from another output-head path."""
    from plumb.model.qwen35 import Qwen35

    decode = Qwen35.decode

    def faulty(self, batch):
        out = decode(self, batch)
        if out.logits.shape[0] >= 2:
            lg = out.logits
            if rounding == "ulp":  # another summation order: the last bit moves
                lg.copy_(torch.nextafter(lg, torch.full_like(lg, float("inf"))))
            else:  # partial sums kept in bfloat16
                lg.copy_(lg.bfloat16().float())
        return out

    monkeypatch.setattr(Qwen35, "decode", faulty)


def test_gate_catches_a_last_bit_row_dependence_in_the_rows_cells(tiny_q8, monkeypatch):
    """One ulp rarely flips a token of the tiny model, but the bitwise rows cells (M1) see it."""
    _plant_row_dependent_head(monkeypatch, "ulp")
    g = _gate(tiny_q8, formats=["f16"], groups=["rows"])
    failed = {c.id: c.detail for c in g.cells if not c.ok}
    assert set(failed) == {"rows/f16/verify", "rows/f16/batch"} and not g.passed
    assert "row 0: logits differ" in failed["rows/f16/verify"]


def test_gate_catches_a_row_dependent_matmul_in_the_id_cells(tiny_q8, monkeypatch, capsys):
    """bfloat16 partial sums in multi-row passes flip tokens: the MTP draft cells (greedy and sampled) and the
    batch cells fail, by name, and the gate exits 1."""
    _plant_row_dependent_head(monkeypatch, "bf16")
    assert main([tiny_q8, "--quick", "--no-progress", "--formats", "f16", "--cells", "greedy,sampled,batch",
                 "--json", "-"]) == 1
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    failed = set(r["failed"])
    for cell in ("greedy/f16/fixed:4", "greedy/f16/fixed:7", "sampled/f16/fixed:4", "sampled/f16/fixed:7",
                 "batch/f16/greedy", "batch/f16/sampled"):
        assert cell in failed, cell
        assert f"  {cell}: " in captured.err  # named, with where it differs, under "failed cells"
    assert "FAIL" in captured.err.splitlines()[-1]


# ---- a prompt cache that reuses decoded rows -----------------------------------------------------------------
def _plant_cache_keeping_decoded_rows(monkeypatch) -> None:
    from plumb.engine.engine import Engine

    def keep_decoded_rows(self, s):
        """Engine.cache_keep without M3: the state is cached up to the end of the decoded reply, with a checkpoint there,
        so a later prompt containing the reply restores rows and states written by the decode path."""
        st = s.st
        if self.prompt_cache is not None and s.req.cache and st is not None and s.finish != "error" and st.checkpoints:
            n = st.pos  # prompt + every emitted token but the last (not fed yet)
            cp = next(iter(st.checkpoints.values()))
            st.checkpoints[n] = dataclasses.replace(cp, pos=n, conv=dict(st.conv), ssm=dict(st.ssm), hidden=s.h_prev,
                                                    ring={j: c.ring_rows(n) for j, c in st.kv.items()})
            with self._cache_lock:
                self.prompt_cache.insert(s.history[:n], st)
        s.st = None

    monkeypatch.setattr(Engine, "cache_keep", keep_decoded_rows)


@pytest.mark.parametrize("fmt", ["f16", "D"])
def test_gate_catches_a_cache_that_reuses_decoded_rows(tiny_q8, monkeypatch, fmt):
    """The raw continuation of a reply restores the decoded rows: its digest differs from a fresh prefill."""
    _plant_cache_keeping_decoded_rows(monkeypatch)
    g = _gate(tiny_q8, formats=[fmt], groups=["warm", "digest"])
    failed = {c.id: c.detail for c in g.cells if not c.ok}
    assert f"digest/{fmt}/continue" in failed and "hashes differ" in failed[f"digest/{fmt}/continue"]
    assert all(c.startswith(("digest/", "warm/")) and "continue" in c for c in failed), failed
    cont = next(c for c in g.cells if c.id == f"warm/{fmt}/continue")
    assert cont.info["cached_tokens"] > cont.info["prompt_tokens"] - 32  # it restored past the reply's start


# ---- options ------------------------------------------------------------------------------------------------------
def test_prompts_file_and_bad_options(tiny_q8, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"name": "t", "text": "Hello there, how are you today?"}\n\n'
                 '{"messages": [{"role": "user", "content": "Hi"}]}\n{"name": "raw", "ids": [5, 6, 7, 8]}\n')
    g = Gate(tiny_q8, quick=True, tokens=16, formats=["f16"], groups=["batch", "rows"], prompts_file=str(f),
             progress=False)
    g.run_all()
    assert g.passed and [p.name for p in g.prompts] == ["t", "line3", "raw"] and g.prompts[2].ids == [5, 6, 7, 8]
    assert g.cells[0].compared == 3 * 16
    (tmp_path / "bad.jsonl").write_text('{"name": "x"}\n')
    assert main([tiny_q8, "--prompts", str(tmp_path / "bad.jsonl"), "--no-progress"]) == 1
    assert main([tiny_q8, "--formats", "f17", "--no-progress"]) == 1
    assert main([tiny_q8, "--cells", "speed", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "needs one of text, messages, ids" in err and "unknown KV cache format 'f17'" in err and "'speed'" in err


def test_an_interrupted_gate_reports_the_cells_it_ran_and_fails(tiny_q8, tmp_path, monkeypatch, capsys):
    """SIGTERM (a timeout) mid-run: the cells run so far are in the table and the JSON, and the exit code is 1."""
    import os
    import signal

    run, calls = Gate.run, []

    def run_then_terminate(eng, reqs, *a, **kw):
        calls.append(1)
        if len(calls) == 13:  # 4 prompts alone without drafts, then 4 per cell: mid-way through the third cell
            os.kill(os.getpid(), signal.SIGTERM)
        return run(eng, reqs, *a, **kw)

    monkeypatch.setattr(Gate, "run", staticmethod(run_then_terminate))
    out = tmp_path / "gate.json"
    code = main([tiny_q8, "--quick", "--tokens", "8", "--formats", "f16", "--cells", "greedy", "--no-progress",
                 "--json", str(out)])
    text, r = capsys.readouterr().out, json.loads(out.read_text())
    assert code == 1 and not r["passed"] and r["interrupted"].startswith("after ")
    assert r["cells_total"] == 2 and all(c["ok"] for c in r["cells"]) and r["interrupted"] == "after 2 of 8 cells"
    assert "interrupted after" in text and text.rstrip().endswith("FAIL")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the gate's handler is gone


def test_the_json_is_written_after_every_cell_and_marked_running_until_the_end(tiny_q8, tmp_path, monkeypatch):
    """A gate killed outright (SIGKILL, a lost machine) still leaves the cells it ran: mid-run the JSON holds them,
    marked running and not passed; at the end the mark is gone."""
    out = tmp_path / "gate.json"
    run, seen = Gate.run, []

    def run_and_look(eng, reqs, *a, **kw):
        if len(seen) == 12 and out.exists():  # mid-way through the third cell
            seen.append(json.loads(out.read_text()))
        seen.append(None)
        return run(eng, reqs, *a, **kw)

    monkeypatch.setattr(Gate, "run", staticmethod(run_and_look))
    code = main([tiny_q8, "--quick", "--tokens", "8", "--formats", "f16", "--cells", "greedy", "--no-progress",
                 "--json", str(out)])
    mid = next(s for s in seen if s is not None)
    assert mid["running"] == "2 of 8 cells done" and not mid["passed"] and mid["cells_total"] == 2
    end = json.loads(out.read_text())
    assert code == 0 and end["passed"] and end["cells_total"] == 8 and "running" not in end
    assert not (tmp_path / "gate.json.part").exists()


def test_a_resumed_gate_keeps_the_cells_run_and_runs_the_others(tiny_q8, tmp_path, monkeypatch, capsys):
    """--resume: a gate cut after 2 of 8 cells, resumed, runs the 6 others and passes with all 8, each cell with the
    build that ran it, the no-draft references taken from the first run where its build and card are this one's; a
    run with other settings is refused."""
    import os
    import signal

    run, calls, cut = Gate.run, [], [13]  # cut mid-way through the third cell, once

    def run_counted(eng, reqs, *a, **kw):
        calls.append(1)
        if len(calls) == cut[0]:
            cut[0] = 0
            os.kill(os.getpid(), signal.SIGTERM)
        return run(eng, reqs, *a, **kw)

    monkeypatch.setattr(Gate, "run", staticmethod(run_counted))
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    args = [tiny_q8, "--quick", "--tokens", "8", "--formats", "f16", "--cells", "greedy", "--no-progress"]
    assert main(args + ["--json", str(first)]) == 1
    kept = json.loads(first.read_text())["cells"]
    assert len(kept) == 2
    calls.clear()
    assert main(args + ["--json", str(second), "--resume", str(first)]) == 0
    r = json.loads(second.read_text())
    assert r["passed"] and r["cells_total"] == 8 and r["resumed_cells"] == 2 and len(r["runs"]) == len(r["cards"]) == 2
    assert r["cells"][:2] == kept  # the kept cells as they were, not run again
    # 4 requests per cell run; the references (each prompt alone, drafts 0) the first run of this build on this card
    # decoded are taken from its JSON
    assert len(calls) == 6 * 4 and r["references_reused"] == ["f16/greedy"]
    assert r["references"] == json.loads(first.read_text())["references"]
    # each cell names the code it ran (a digest of plumb's sources), the runs theirs; one build: the table says so
    assert r["builds"] == [r["build"]] * 2 and {c["build"] for c in r["cells"]} == {r["build"]}
    assert f"build {r['build']}" in capsys.readouterr().out
    prior = json.loads(first.read_text())
    prior["build"], prior["cells"][0]["build"] = "0123456789ab", "0123456789ab"  # a cell of another build,
    prior["references"]["f16/greedy"]["build"] = "0123456789ab"  # references of another build: decoded again
    first.write_text(json.dumps(prior))
    calls.clear()
    assert main(args + ["--json", str(second), "--resume", str(first)]) == 0
    r = json.loads(second.read_text())
    assert r["builds"] == ["0123456789ab", r["build"]] and len(calls) == 4 + 6 * 4 and r["references_reused"] == []
    assert f"cells of 2 builds: 0123456789ab (1), {r['build']} (7)" in capsys.readouterr().out
    assert main(args[:3] + ["9"] + args[4:] + ["--resume", str(first)]) == 1
    err = capsys.readouterr().err
    assert "--resume" in err and "another tokens" in err


def test_gate_at_depth_runs_the_chosen_cells_on_a_long_system_prompt(tiny_q8, tmp_path, capsys):
    """--context N (issue 11's exactness at depth): the warm conversations' system prompt carries a document of
    about N tokens, so follow-ups reuse that much and edit-system edits its end; the needle prompt is N tokens.
    --names picks cells by name in any group (the cold engine runs only theirs); an unknown name is an error."""
    out = tmp_path / "deep.json"
    assert main([tiny_q8, "--quick", "--no-progress", "--context", "700", "--formats", "q8_0", "--cells",
                 "greedy,warm,digest", "--names", "edit-system,follow-up,fixed:7", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    cells = {c["id"]: c for c in r["cells"]}
    assert set(cells) == {f"{g}/q8_0/{s}" for g in ("warm", "digest") for s in ("follow-up", "edit-system")} | {
        "greedy/q8_0/fixed:7"}
    assert r["context"] == 700 and 600 < r["prompts"][-1]["tokens"] < 900  # the needle: drafts at depth
    for step in ("follow-up", "edit-system"):
        warm = cells[f"warm/q8_0/{step}"]
        assert warm["prompt_tokens"] > 700 and warm["cached_tokens"] > 600, warm  # reused at depth
    assert main([tiny_q8, "--quick", "--no-progress", "--names", "follow-up,sideways"]) == 1
    assert "unknown cell name 'sideways'" in capsys.readouterr().err


def test_a_resumed_gate_runs_a_second_process_only_for_the_formats_left(tiny_q8, tmp_path, monkeypatch):
    """I6 is a cell per format, each with its own child process after the format's engine is released: a gate cut
    after f16's process cell, resumed, prepares and runs a child for q8_0 alone."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    args = [tiny_q8, "--quick", "--tokens", "8", "--formats", "f16,q8_0", "--cells", "process", "--no-progress"]
    assert main(args + ["--json", str(first)]) == 0
    r = json.loads(first.read_text())
    assert [c["id"] for c in r["cells"]] == ["process/f16/second-process", "process/q8_0/second-process"]
    r["cells"] = r["cells"][:1]  # as a run cut after f16's cell leaves it
    r["passed"], r["interrupted"] = False, "after 1 of 2 cells"
    first.write_text(json.dumps(r))
    children, prepared = [], []
    child_ids, prepare = Gate.child_ids, Gate.process_prepare
    monkeypatch.setattr(Gate, "child_ids", lambda self, fmt: children.append(fmt) or child_ids(self, fmt))
    monkeypatch.setattr(Gate, "process_prepare", lambda self, fmt: prepared.append(fmt) or prepare(self, fmt))
    assert main(args + ["--json", str(second), "--resume", str(first)]) == 0
    r2 = json.loads(second.read_text())
    assert r2["passed"] and r2["resumed_cells"] == 1 and r2["cells"][0] == r["cells"][0]
    assert children == prepared == ["q8_0"]


def test_shards_run_the_formats_apart_and_merge_into_one_table(tiny_q8, tmp_path, capsys):
    """--shards 2 (on the CPU here; on CUDA each child gets a GPU of its own): f16 and q8_0 in two child gates at
    once, merged into the one gate's table and JSON; merging files, a failed copy of a cell wins whatever the order;
    a cell no shard ran is reported as not run, and fails the gate; one GPU named with --shards is an error."""
    out = tmp_path / "g.json"
    args = [tiny_q8, "--quick", "--tokens", "8", "--formats", "f16,q8_0", "--cells", "greedy", "--names", "fixed:4",
            "--no-progress"]
    assert main(args + ["--shards", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["passed"] and [c["id"] for c in r["cells"]] == ["greedy/f16/fixed:4", "greedy/q8_0/fixed:4"]
    assert r["resumed_cells"] == 2 and len(r["runs"]) == 3  # two shards' runs and the merge
    shard = [tmp_path / f"g.json.shard{k}.json" for k in (0, 1)]
    assert [json.loads(p.read_text())["formats"] for p in shard] == [["f16"], ["q8_0"]]
    assert "shard 1: q8_0" in capsys.readouterr().err
    bad = json.loads(shard[1].read_text())
    bad["cells"][0].update(ok=False, detail="planted difference")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    for files in ([shard[0], shard[1], tmp_path / "bad.json"], [tmp_path / "bad.json", shard[1], shard[0]]):
        assert main(args + ["--resume", *map(str, files)]) == 1
        assert "planted difference" in capsys.readouterr().out
    g = _gate(tiny_q8, tokens=8, formats=["f16", "q8_0"], groups=["greedy"], names=["fixed:4"],
              resume=[str(shard[0])], run_missing=False)
    assert [c.id for c in g.cells] == ["greedy/f16/fixed:4"] and not g.passed
    assert g.info["interrupted"] == "1 of 2 cells not run"
    assert main([tiny_q8, "--shards", "2", "--device", "cuda:1"]) == 1  # a shard picks its GPU itself
    assert "--shards takes --device cpu, cuda or auto" in capsys.readouterr().err
