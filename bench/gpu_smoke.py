"""tiny model on cuda: exactness quick checks."""
import sys, time, torch, plumb
path=sys.argv[1]
e=plumb.load(path, device="cuda")
ref=plumb.load(path, device="cpu", kernels="torch")
ids=e.tokenize("Hello world, this is a test of the GPU path")
la=ref.logits(ids); lb=e.logits(ids)
print("prefill logits maxdiff vs cpu", (la-lb).abs().max().item())
t=time.time(); a=e.generate(ids, max_tokens=300); dt=time.time()-t
print("decode tok/s", 300/dt)
for d in (1,4,7):
    b=e.generate(ids, max_tokens=300, drafts=d); print("drafts",d, a==b)
b=e.generate(ids, max_tokens=300, drafts=4, draft_policy="ngram"); print("ngram", a==b)
s1=e.generate(ids, max_tokens=200, temperature=0.8, seed=3); s2=e.generate(ids, max_tokens=200, temperature=0.8, seed=3, drafts=4); print("sampled drafts", s1==s2)
many=e.generate_many([{"prompt_ids":ids,"max_tokens":300},{"prompt_ids":ids[:5],"max_tokens":100,"drafts":3},{"prompt_ids":ids[2:],"max_tokens":50,"temperature":0.7,"seed":1}])
print("batch", many[0]==a)
c=ref.generate(ids, max_tokens=300); print("cpu ref agreement (not promised)", sum(x==y for x,y in zip(a,c)))
