"""llama.cpp's sampler chain (llama-cpp-python's LlamaSampler): the engine's generation loop samples
through it (only the native layer touches llama_cpp objects).

The chain, in llama.cpp's own order (common/sampling.cpp): logit bias, grammar (if any), penalties, top-k, top-p,
min-p, temperature, seeded draw; greedy at temperature 0 keeps the grammar and the penalties and
takes the most likely token that is left. llama_sampler_sample applies the chain to the context's
logits and then accepts the chosen token into every sampler of it, so the grammar and the penalties
see every token the answer is made of, and nothing else.
"""

from __future__ import annotations

import json


class GrammarError(ValueError):
    """A GBNF grammar llama.cpp does not parse, or a JSON schema that does not convert to one."""


def make_sampler(temperature: float, top_k: int, top_p: float, seed: int, *, min_p: float = 0.0,
                 repeat_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 penalty_last_n: int = 64, recent: list[int] | None = None,
                 logit_bias: dict[int, float] | None = None, grammar: str | None = None, model=None):
    """A sampler chain: greedy at temperature 0, else top-k (0 = off), top-p, min-p (0 = off),
    temperature, seeded draw. Penalties (repeat 1 and presence/frequency 0 = off) look at the last
    penalty_last_n tokens, starting with `recent` (the conversation before the answer, as llama-server
    feeds its prompt in). grammar: GBNF text (needs model: native.runtime.Model), raises GrammarError
    when llama.cpp does not parse it. logit_bias: token id -> bias added first (needs model). The caller
    closes it (.close())."""
    from page_local.native import pageops

    lc = pageops.llama_cpp()
    from llama_cpp import _internals

    smp = _internals.LlamaSampler()
    try:
        if logit_bias:
            smp.add_logit_bias(model.n_vocab, logit_bias)
        if grammar is not None:
            lc.llama_sampler_chain_add(smp.sampler, _grammar_sampler(model, grammar))
        if repeat_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0:
            smp.add_penalties(model.n_vocab if model is not None else 0, penalty_last_n, repeat_penalty,
                              frequency_penalty, presence_penalty)
            pen = lc.llama_sampler_chain_get(smp.sampler, lc.llama_sampler_chain_n(smp.sampler) - 1)
            for tok in (recent or [])[-penalty_last_n:] if penalty_last_n > 0 else []:
                lc.llama_sampler_accept(pen, int(tok))  # the penalties only: the grammar starts at the answer
        if temperature <= 0:
            smp.add_greedy()
        else:
            if top_k > 0:
                smp.add_top_k(top_k)
            smp.add_top_p(top_p, 1)
            if min_p > 0:
                smp.add_min_p(min_p, 1)
            smp.add_temp(temperature)
            smp.add_dist(seed)
    except BaseException:
        smp.close()
        raise
    return smp


def _grammar_sampler(model, grammar: str):
    """llama_sampler_init_grammar, checked: llama.cpp returns NULL (and logs why) for a grammar it does
    not parse, which LlamaSampler.add_grammar would put in the chain as it is."""
    from page_local.native import llama_log, pageops

    if model is None:
        raise ValueError("a grammar needs the model (its vocabulary)")
    lc = pageops.llama_cpp()
    with llama_log.held() as log:
        ptr = lc.llama_sampler_init_grammar(model.vocab, grammar.encode("utf-8"), b"root")
        if not ptr:
            reason = log.reason()
            log.mark_reported()
            raise GrammarError("llama.cpp could not parse the grammar" + (f": {reason}" if reason else ""))
    return ptr


def check_grammar(model, grammar: str) -> None:
    """Parse `grammar` (GBNF, root rule `root`) against the model's vocabulary; GrammarError if it
    does not parse. Cheap: the grammar is built and freed."""
    from page_local.native import pageops

    lc = pageops.llama_cpp()
    lc.llama_sampler_free(_grammar_sampler(model, grammar))


def schema_to_grammar(schema: dict | bool) -> str:
    """A JSON schema -> GBNF, by llama-cpp-python's converter (llama_cpp.llama_grammar, a port of
    llama.cpp's json_schema_to_grammar.py). GrammarError with the converter's reason."""
    from page_local.native import pageops

    pageops.llama_cpp()  # the patched library first: importing llama_cpp binds to the first one found
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except RecursionError:
        raise GrammarError("the JSON schema nests too deeply to convert") from None
    except Exception as e:  # the converter raises ValueError, KeyError, TypeError, ... on schemas it cannot read
        raise GrammarError(f"the JSON schema could not be converted to a grammar ({type(e).__name__}: {e})") \
            from None
    # llama-cpp-python 0.3.36's string character is [^"\\], which lets a raw newline or tab into a JSON
    # string (invalid JSON: a model wrote "Paris }\n\nParis" into a string field); llama.cpp's own converter
    # (common/json-schema-to-grammar.cpp) excludes the control characters, as JSON does
    return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)


_LOOSE_CHAR = r'char ::= [^"\\] | '
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | '


def json_grammar() -> str:
    """GBNF for any JSON object (response_format json_object): llama.cpp's grammars/json.gbnf."""
    return schema_to_grammar({"type": "object"})


def sample(sampler, ctx) -> int:
    """Sample from the logits of the context's last decoded token (ctx: native.runtime.Context);
    every sampler of the chain accepts the token."""
    from llama_cpp import llama_cpp as lc

    return int(lc.llama_sampler_sample(sampler.sampler, ctx.ptr, -1))
