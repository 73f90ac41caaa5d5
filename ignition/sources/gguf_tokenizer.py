"""GGUF tokenizer metadata -> an HF `tokenizers` Tokenizer plus the tokenizer_config subset.

Rebuilds, with the `tokenizers` library alone, the backend that transformers builds from the same file
(`AutoTokenizer.from_pretrained(dir, gguf_file=NAME)`, transformers/integrations/gguf/), so a GGUF core
tokenizes like the transformers oracle. The one deliberate difference is the `smollm`-class
pre-tokenizers: transformers has no split for them and falls back to GPT-2's; we split digits the way
llama.cpp and the original HF tokenizer.json do. Must not import transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from ignition.errors import ExportError

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> split regex, as transformers' GGUF_PRE_TOKENIZER_SPLITS
_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# llama.cpp splits every digit off first, then applies GPT-2's regex: exactly HF's Digits + ByteLevel.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# GPT-2's own regex (ByteLevel's built-in); a file without `pre` predates the key and gets it too.
_GPT2 = ("gpt2", "default", "mpt", "olmo", "jais")

# Architectures whose sentencepiece vocabulary transformers builds as Gemma's (not Llama's).
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def build_tokenizer(arch: str, meta: Mapping[str, Any], where: str) -> tuple[Tokenizer, dict[str, Any]]:
    """Return the backend tokenizer and the tokenizer_config subset (special token strings, add_*_token)."""
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ExportError(f"{where}: GGUF has no tokenizer.ggml.tokens, so no tokenizer can be built")
    kind = meta.get("tokenizer.ggml.model")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    try:
        if kind == "gpt2":
            tok, vocab = _byte_level(meta, tokens, where)
            defaults: tuple[str, ...] = ("<|endoftext|>",)  # GPT2Tokenizer's unk/bos/eos
        elif kind == "llama" and arch in _GEMMA_ARCHS:
            tok, vocab = _gemma_sentencepiece(tokens)
            defaults = ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")  # GemmaTokenizer's named tokens
        elif kind == "llama":
            tok, vocab = _llama_sentencepiece(meta, tokens, where)
            defaults = ("<unk>", "<s>", "</s>")  # LlamaTokenizer's named tokens
        else:
            raise ExportError(f"{where}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    except ExportError:
        raise
    except Exception as e:  # the tokenizers library rejects inconsistent vocabularies (a merge of unknown tokens)
        raise ExportError(f"{where}: invalid GGUF tokenizer ({e})") from None

    config = _tokenizer_config(meta, tokens, kind)
    named = [config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config[k] is not None]
    _add_special_tokens(tok, tokens, types, vocab, byte_level=kind == "gpt2", named=[*defaults, *named])
    tok.post_processor = _post_processor(config, meta)
    return tok, config


def _tokenizer_config(meta: Mapping[str, Any], tokens: list[str], kind: str | None) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise (transformers agrees)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    bos, eos = token("bos_token_id"), token("eos_token_id")
    return {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        # a flag naming a missing token is void (transformers' update_post_processor does the same)
        "add_bos_token": bool(add_bos) and bos is not None,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def _byte_level(meta: Mapping[str, Any], tokens: list[str], where: str) -> tuple[Tokenizer, dict[str, int]]:
    """GPT-2 style byte-level BPE (GPT2Tokenizer, then the file's split regex)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet is a llama.cpp mislabel (raw UTF-8): respell it.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = []
    for merge in meta.get("tokenizer.ggml.merges") or []:
        pair = tuple(merge.split(" "))
        if len(pair) != 2:
            raise ExportError(f"{where}: malformed tokenizer merge {merge!r}")
        merges.append(pair)
    bpe = BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
              fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.decoder = decoders.ByteLevel()
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif pre in _GPT2:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        # guessing a split would silently tokenize differently from the model's training
        raise ExportError(f"{where}: unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
    return tok, vocab


def _gemma_sentencepiece(tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    """Gemma's sentencepiece vocabulary as BPE with byte fallback (GemmaTokenizer's backend).

    Gemma files store whitespace-only tokens with real spaces where the model's pieces use U+2581, and list
    no merges: they are rebuilt from the vocabulary, best-first in file order (Gemma's scores do not follow
    its merge order).
    """
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    positions = {t: -i for i, t in enumerate(respelled)}
    tok = Tokenizer(
        BPE(vocab=vocab, merges=_merges_from_vocab(vocab, positions), fuse_unk=True, unk_token="<unk>",
            dropout=None, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


def _llama_sentencepiece(meta: Mapping[str, Any], tokens: list[str], where: str) -> tuple[Tokenizer, dict[str, int]]:
    """Llama-2 style sentencepiece vocabulary as BPE with byte fallback (LlamaTokenizer's backend)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ExportError(f"{where}: sentencepiece GGUF has neither merges nor scores")
        merges = _merges_from_vocab(vocab, dict(zip(tokens, scores)))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    # transformers' LlamaTokenizer: prefix space on the first word only, stripped again on decode
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return tok, vocab


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best score first (transformers' generate_merges)."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    # NOTE: sorted(reverse=True) keeps ties in insertion order; the order must equal transformers' exactly
    merges = sorted(merges, key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(
    tok: Tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int], byte_level: bool, named: list[str]
) -> None:
    """CONTROL tokens (and the named specials) become special added tokens, USER_DEFINED plain added tokens.

    Matched whole in the text, as llama.cpp does. Nothing is added that is not already in the vocabulary,
    so the tokenizer never outgrows the model's embedding.
    """
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    special = [
        t for t, kind in zip(tokens, types) if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    special += [t for t in dict.fromkeys(named) if t in vocab and t not in set(special)]
    seen = set(special)
    if special:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab and t not in seen]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(config: dict[str, Any], meta: Mapping[str, Any]) -> processors.TemplateProcessing:
    """BOS/EOS insertion as transformers' update_post_processor writes it."""
    bos, eos = config["bos_token"], config["eos_token"]
    add_bos, add_eos = config["add_bos_token"], config["add_eos_token"]
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = [(bos, meta["tokenizer.ggml.bos_token_id"])] if add_bos else []
    specials += [(eos, meta["tokenizer.ggml.eos_token_id"])] if add_eos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))
