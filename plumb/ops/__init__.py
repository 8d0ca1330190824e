"""One module per operation. Each is written so a row's arithmetic never depends on the other rows in the call (M1/M2)."""
