"""BERT WordPiece tokenizer in plain Python (no `transformers`, no `tokenizers`).

Reproduces Hugging Face's BertTokenizer for ordinary text:
  1. basic tokenizer: drop control characters and U+FFFD, map whitespace to ' ', put spaces
     around CJK ideographs, split on whitespace; per word: lowercase and strip accents (NFD,
     drop combining marks) when the model is uncased, then split off every punctuation char;
  2. WordPiece: greedy longest-match-first against vocab.txt, continuation pieces prefixed
     '##'; a word with no full segmentation (or longer than 100 chars) becomes [UNK].
Special-token strings typed in the text ("[SEP]", "[MASK]", ...) become those special tokens,
as in Hugging Face.
"""
import json
import os
import re
import unicodedata


def load_vocab(path):
    """vocab.txt -> {token: id}; the id is the line number (0-based)."""
    vocab = {}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            tok = line.rstrip("\n").rstrip("\r")
            if tok not in vocab:
                vocab[tok] = i
    return vocab


def _is_whitespace(ch):
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch):
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch).startswith("C")


def _is_punctuation(ch):
    cp = ord(ch)
    # All non-letter/number ASCII counts as punctuation for BERT ("$", "^", "`" ...).
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp):
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class BasicTokenizer:
    def __init__(self, do_lower_case=True, strip_accents=None, tokenize_chinese_chars=True):
        self.do_lower_case = do_lower_case
        # None means "follow do_lower_case", as in Hugging Face.
        self.strip_accents = do_lower_case if strip_accents is None else bool(strip_accents)
        self.tokenize_chinese_chars = tokenize_chinese_chars

    def _clean(self, text):
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            if _is_whitespace(ch):
                out.append(" ")
            elif self.tokenize_chinese_chars and _is_cjk(cp):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        return "".join(out)

    @staticmethod
    def _split_punct(word):
        pieces, cur = [], []
        for ch in word:
            if _is_punctuation(ch):
                if cur:
                    pieces.append("".join(cur))
                    cur = []
                pieces.append(ch)
            else:
                cur.append(ch)
        if cur:
            pieces.append("".join(cur))
        return pieces

    def tokenize(self, text):
        text = unicodedata.normalize("NFC", self._clean(text))
        words = []
        for word in text.split():
            if self.do_lower_case:
                word = word.lower()
            if self.strip_accents:
                word = "".join(c for c in unicodedata.normalize("NFD", word)
                               if unicodedata.category(c) != "Mn")
            words.extend(p for p in self._split_punct(word) if p)
        return words


class WordpieceTokenizer:
    def __init__(self, vocab, unk_token="[UNK]", max_input_chars_per_word=100, prefix="##"):
        self.vocab, self.unk_token = vocab, unk_token
        self.max_chars, self.prefix = max_input_chars_per_word, prefix

    def tokenize(self, word):
        if len(word) > self.max_chars:
            return [self.unk_token]
        pieces, start = [], 0
        while start < len(word):
            end, cur = len(word), None
            while start < end:
                sub = word[start:end]
                if start > 0:
                    sub = self.prefix + sub
                if sub in self.vocab:
                    cur = sub
                    break
                end -= 1
            if cur is None:
                return [self.unk_token]
            pieces.append(cur)
            start = end
        return pieces


def _token_str(value, default):
    """tokenizer_config.json stores special tokens as strings or {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else default


class BertTokenizer:
    """Tokenizer of a BERT model directory (vocab.txt [+ tokenizer_config.json / tokenizer.json])."""

    def __init__(self, vocab, do_lower_case=True, strip_accents=None, tokenize_chinese_chars=True,
                 unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                 mask_token="[MASK]", lowercase_source="default"):
        self.vocab = vocab
        self.inv_vocab = {i: t for t, i in vocab.items()}
        self.basic = BasicTokenizer(do_lower_case, strip_accents, tokenize_chinese_chars)
        self.wordpiece = WordpieceTokenizer(vocab, unk_token)
        self.do_lower_case = do_lower_case
        self.lowercase_source = lowercase_source
        for name, tok in (("unk", unk_token), ("cls", cls_token), ("sep", sep_token)):
            if tok not in vocab:
                raise ValueError(f"vocab.txt has no {name} token {tok!r}")
        self.unk_token, self.cls_token, self.sep_token = unk_token, cls_token, sep_token
        self.unk_id, self.cls_id, self.sep_id = vocab[unk_token], vocab[cls_token], vocab[sep_token]
        specials = sorted({t for t in (unk_token, cls_token, sep_token, pad_token, mask_token) if t in vocab},
                          key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in specials) + ")")

    @classmethod
    def from_dir(cls, model_dir):
        """Reads vocab.txt and the casing / special tokens from tokenizer_config.json, else
        tokenizer.json's normalizer, else guesses from the vocabulary (cased if it holds 'The')."""
        vocab = load_vocab(os.path.join(model_dir, "vocab.txt"))
        kw, source = {}, None
        tc_path = os.path.join(model_dir, "tokenizer_config.json")
        tj_path = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(tc_path):
            with open(tc_path, encoding="utf-8") as f:
                tc = json.load(f)
            if "do_lower_case" in tc:
                kw["do_lower_case"], source = bool(tc["do_lower_case"]), "tokenizer_config.json"
            if tc.get("strip_accents") is not None:
                kw["strip_accents"] = bool(tc["strip_accents"])
            if "tokenize_chinese_chars" in tc:
                kw["tokenize_chinese_chars"] = bool(tc["tokenize_chinese_chars"])
            for key in ("unk_token", "cls_token", "sep_token", "pad_token", "mask_token"):
                if key in tc:
                    kw[key] = _token_str(tc[key], None) or kw.get(key, None)
            kw = {k: v for k, v in kw.items() if v is not None}
        if source is None and os.path.isfile(tj_path):
            with open(tj_path, encoding="utf-8") as f:
                norm = (json.load(f).get("normalizer") or {})
            if norm.get("type") == "BertNormalizer" and "lowercase" in norm:
                kw["do_lower_case"], source = bool(norm["lowercase"]), "tokenizer.json"
        if source is None:
            kw["do_lower_case"], source = "The" not in vocab, "guessed from vocab.txt"
        return cls(vocab, lowercase_source=source, **kw)

    def tokenize(self, text):
        out = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:  # a special-token string, kept whole
                out.append(part)
                continue
            for word in self.basic.tokenize(part):
                out.extend(self.wordpiece.tokenize(word))
        return out

    def encode(self, text):
        """Token ids of `text`, without [CLS]/[SEP]."""
        return [self.vocab[t] for t in self.tokenize(text)]

    def decode_tokens(self, ids):
        return [self.inv_vocab.get(int(i), "?") for i in ids]
