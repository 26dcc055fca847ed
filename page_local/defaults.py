"""The defaults a user meets, written once: the Engine's signature, the CLI's options and the docs use them."""

BUDGET = 0.25  # fraction of the prompt's cells kept when the gate opens (or an absolute count)
EVICTOR = "snapkv"
GATE = "verify"  # self-verification: the answer is checked on the evicted cache before it is committed
N_CTX = 4096
THREADS = 2
MAX_TOKENS = 256
ON_FULL = "evict"  # a turn that does not fit evicts earlier turns (engine/room.py); "refuse" raises ContextFull
LADDER = (1 / 16, 1 / 8, 1 / 4, 1 / 2)  # the budgets gate mode "search" tries, smallest first
