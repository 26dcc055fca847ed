"""The defaults a user meets, written once: the Engine's signature, the CLI's options and the docs use them."""

BUDGET = 0.25  # fraction of the prompt's cells kept when the gate opens (or an absolute count)
# chat and serve: eviction for speed by parking (engine/parking.py): the cells outside a quarter of the conversation
# leave the attention, not memory, and every message chooses again among all of them. Evicting for good lost
# later-turn answers (docs/results.md "Conversations": SmolLM2 0.52 vs 0.58, Qwen2.5-Coder 1x 0.83 vs 1.00);
# parking lost none (0/0 discordant on 306 turns, and on 153 later questions after long answers) and decodes
# at the full cache's speed or faster ("Parking in conversations", "Long answers"). --budget 1.0 keeps the
# whole conversation in the attention (room on demand only).
CHAT_BUDGET = 0.25
CHAT_PARK = True  # chat and serve: a speed budget below 1 parks cells instead of deleting them
# chat and serve: a message after one that room-making cut reads the conversation again (engine/room.py) when the
# sentence its question's words meet best went with the cut. Real prose at 4x n_ctx 512 (SmolLM2, 16 second
# questions; docs/results.md, "Reading again by the words"): 8 answered against the full cache's 6, as reading again
# always does, where not reading again answered 1; it read again 12 times of 16, exactly where the asked fact's
# sentence was not held whole (issue 57)
CHAT_REREAD = "words"
# when a message after a cut reads the conversation again (engine/room.py, "Reading again"): never; when the
# sentence its question's words meet best (BM25) is one the cut deleted ("words"); or always
REREADS = ("never", "words", "always")
# chat and serve: the speed budget keeps whole sentences, as room-making does. On multi-turn magic-number chats at
# a quarter of the cache the verify check passed on 0 of 54 turns with snapkv's pooled cells (the value's last
# digits lost) and on most with sentences (docs/results.md, "Parking in conversations")
CHAT_EVICTOR = "snapkv-spans"
EVICTOR = "snapkv"
GATE = "verify"  # self-verification: the answer is checked on the evicted cache before it is committed
N_CTX = 4096
THREADS = 2
MAX_TOKENS = 256
ON_FULL = "evict"  # a turn that does not fit evicts earlier turns (engine/room.py); "refuse" raises ContextFull
LADDER = (1 / 16, 1 / 8, 1 / 4, 1 / 2)  # the budgets gate mode "search" tries, smallest first
# chat and serve: budget search (gate "search") over a quarter, else half of the conversation, parking what it
# leaves out. On the 7K chat of 256-token answers (docs/benchmarks.md, "Chat's default"): every turn from
# park_from passed one of the two, 1.12-1.48x the full cache's decode, against one turn in four with verify at a
# quarter; eval conversations' park-search policy (docs/results.md, "Long answers")
CHAT_GATE = "search"
CHAT_LADDER = (1 / 4, 1 / 2)
# the attention path and KV cache type (engine/attention.py): "auto" is page-local's measured choice
FLASH_ATTN = ("auto", "on", "off")
CACHE_TYPES = ("f16", "q8_0", "q4_0")
FLASH_ENV = "PAGE_LOCAL_FLASH_ATTN"  # the default of --flash-attn and Engine(flash_attn=None)
CACHE_ENV = "PAGE_LOCAL_CACHE_TYPE"  # the default of --cache-type and Engine(cache_type=None)
AUTOTUNE_ENV = "PAGE_LOCAL_AUTOTUNE"  # first-use attention tuning: on (default), off, or a time box in seconds
AUTOTUNE_S = 30.0  # the first-use tuning's time box
