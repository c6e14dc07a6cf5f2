//! Text for a language model: tokenizers, a generated corpus, and next-token batches.
//!
//! - [`Tokenizer`]: byte-level (every UTF-8 byte is a token, vocabulary 256) or a Hugging Face
//!   `tokenizer.json` (GPT-2's byte-level BPE, for one) through the `tokenizers` crate.
//! - [`generated_corpus`]: deterministic English-like text with structure a tiny model learns in
//!   a hundred steps, so a trainer needs no download.
//! - [`TokenData`]: a token stream split into a training and a held-out part, cut into
//!   `[batch, seq]` windows of inputs and next-token targets. Batch `k` depends only on `k`, so
//!   a trainer that resumes at step `k` sees the batches it would have seen.
//!
//! ```
//! use tidemem::data::text::{Split, TokenData, Tokenizer};
//!
//! let tok = Tokenizer::bytes();
//! let ids = tok.encode("héllo")?;
//! assert_eq!(ids.len(), 6); // 'é' is two bytes
//! assert_eq!(tok.decode(&ids)?, "héllo");
//!
//! let data = TokenData::generated(20_000, 7, 0.1)?;
//! assert_eq!(data.vocab(), 256);
//! assert_eq!(data.train().len() + data.val().len(), 20_000);
//! let (x, y) = data.batch(Split::Train, 0, 4, 32)?;
//! assert_eq!((x.len(), y.len()), (4 * 32, 4 * 32));
//! assert_eq!(x[1..32], y[..31]); // targets are the inputs shifted by one
//! assert_eq!(data.batch(Split::Train, 0, 4, 32)?, (x, y)); // the same step, the same batch
//! # Ok::<(), tidemem::Error>(())
//! ```

use std::fmt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::rng::{self, Rng, Xoshiro256};

/// A map between text and token ids.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    Bytes,
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// The byte-level tokenizer: each UTF-8 byte of the text is one token, vocabulary 256.
    /// Encoding then decoding gives the text back exactly.
    pub fn bytes() -> Tokenizer {
        Tokenizer { kind: Kind::Bytes }
    }

    /// A Hugging Face tokenizer loaded from a `tokenizer.json` file (the format of GPT-2's
    /// byte-level BPE, and of the `tokenizers` library's other models).
    ///
    /// Errors with [`Error::FileIo`] when the file cannot be read, and with
    /// [`Error::InvalidArgument`], naming the path, when it is not a tokenizer description.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::FileIo {
            during: "reading tokenizer file",
            path: path.to_path_buf(),
            source,
        })?;
        let hf = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::InvalidArgument(format!(
                "{} is not a tokenizer.json file: {e}",
                path.display()
            ))
        })?;
        Ok(Tokenizer {
            kind: Kind::Hf(Box::new(hf)),
        })
    }

    /// Whether this is the byte-level tokenizer.
    pub fn is_bytes(&self) -> bool {
        matches!(self.kind, Kind::Bytes)
    }

    /// Number of token ids: every id [`encode`](Self::encode) returns is below it. 256 for
    /// bytes; for a Hugging Face tokenizer the model's vocabulary plus its added tokens
    /// (50257 for GPT-2).
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            Kind::Bytes => 256,
            Kind::Hf(hf) => hf.get_vocab_size(true),
        }
    }

    /// The token ids of `text`. Special tokens are not added (GPT-2's tokenizer adds none).
    ///
    /// Errors with [`Error::InvalidArgument`] when a Hugging Face tokenizer refuses the text
    /// (a model without an unknown token meeting a word outside its vocabulary).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Kind::Hf(hf) => hf
                .encode(text, false)
                .map(|enc| enc.get_ids().to_vec())
                .map_err(|e| Error::InvalidArgument(format!("the tokenizer cannot encode: {e}"))),
        }
    }

    /// The text of `ids`. For bytes, sequences that are not valid UTF-8 (a window cut inside a
    /// multi-byte character, a model's sample) decode lossily, with U+FFFD in their place.
    ///
    /// Errors with [`Error::TokenOutOfRange`], naming the position, on an id not below
    /// [`vocab_size`](Self::vocab_size).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let vocab = self.vocab_size();
        if let Some(pos) = ids.iter().position(|&id| id as usize >= vocab) {
            return Err(Error::TokenOutOfRange {
                token: i64::from(ids[pos]),
                position: pos,
                vocab,
            });
        }
        match &self.kind {
            Kind::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&id| id as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Kind::Hf(hf) => hf
                .decode(ids, false)
                .map_err(|e| Error::InvalidArgument(format!("the tokenizer cannot decode: {e}"))),
        }
    }
}

const NAMES: &[&str] = &["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana"];
const ADJECTIVES: &[&str] = &[
    "small", "red", "quiet", "old", "bright", "happy", "green", "heavy",
];
const NOUNS: &[&str] = &["cat", "dog", "bird", "box", "tree", "ship", "lamp", "river"];
const VERBS: &[&str] = &[
    "sees", "finds", "likes", "moves", "paints", "follows", "carries", "watches",
];
const PLACES: &[&str] = &["garden", "market", "hill", "harbor", "old house", "forest"];

/// A deterministic English-like corpus of exactly `bytes` bytes, all ASCII: numbered sentences
/// from a small grammar (names, adjectives, nouns, verbs and places from short word lists), a
/// counting refrain, quoted speech, punctuation, and a blank line between paragraphs of eight
/// lines. The same seed gives the same text; a longer corpus starts with the shorter one.
///
/// The structure (a few dozen words, fixed templates, line numbers that count up) is what a
/// tiny GPT learns within a hundred steps at byte level: its loss falls well below the
/// unigram entropy of the bytes.
///
/// ```
/// use tidemem::data::text::generated_corpus;
/// let text = generated_corpus(500, 1);
/// assert_eq!(text.len(), 500);
/// assert!(text.starts_with("1. "));
/// assert_eq!(text, generated_corpus(500, 1));
/// assert!(generated_corpus(800, 1).starts_with(&text));
/// ```
pub fn generated_corpus(bytes: usize, seed: u64) -> String {
    let mut rng = Xoshiro256::new(rng::derive_seed(seed, 0x7465_7874, 0));
    let mut pick = |words: &[&'static str]| words[rng.below(words.len() as u64) as usize];
    let mut out = String::with_capacity(bytes + 128);
    let mut line = 0u64;
    while out.len() < bytes {
        line += 1;
        out.push_str(&line.to_string());
        out.push_str(". ");
        // Templates weighted 2:2:1:1.
        let sentence = match pick(&["plain", "plain", "name", "name", "quote", "count"]) {
            "plain" => {
                let (a1, n1, v, a2, n2) = (
                    pick(ADJECTIVES),
                    pick(NOUNS),
                    pick(VERBS),
                    pick(ADJECTIVES),
                    pick(NOUNS),
                );
                format!("The {a1} {n1} {v} the {a2} {n2}.")
            }
            "name" => {
                let (name, v, n, p) = (pick(NAMES), pick(VERBS), pick(NOUNS), pick(PLACES));
                format!("{name} {v} the {n} in the {p}.")
            }
            "quote" => {
                let (name, n, other) = (pick(NAMES), pick(NOUNS), pick(NAMES));
                format!("{name} said: \"I like the {n}, and the {n} likes me, {other}!\"")
            }
            _ => {
                let n = pick(NOUNS);
                format!("One, two, three, four, five. The {n} counts again.")
            }
        };
        out.push_str(&sentence);
        out.push('\n');
        if line.is_multiple_of(8) {
            out.push('\n');
        }
    }
    out.truncate(bytes);
    out
}

/// Which part of a [`TokenData`] stream a batch is cut from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training part: the stream without its held-out tail.
    Train,
    /// The held-out tail, for validation loss.
    Val,
}

/// A token stream, split into a training part and a held-out tail, that serves next-token
/// batches.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenData {
    train: Vec<u32>,
    val: Vec<u32>,
    vocab: usize,
}

impl fmt::Debug for TokenData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenData")
            .field("train_tokens", &self.train.len())
            .field("val_tokens", &self.val.len())
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl TokenData {
    /// The stream `tokens` over a vocabulary of `vocab` ids, its last `val_fraction` (rounded
    /// to a whole token) held out for validation.
    ///
    /// Errors with [`Error::Empty`] when `tokens` is empty or the training part would be,
    /// [`Error::TooFew`] or [`Error::TooLarge`] when `vocab` is 0 or above 2^31 (ids are
    /// handed out as `i32`), [`Error::BadValue`] when `val_fraction` is not in `[0, 1)`, and
    /// [`Error::TokenOutOfRange`] when a token is not below `vocab` (naming the first such
    /// position).
    pub fn new(tokens: Vec<u32>, vocab: usize, val_fraction: f64) -> Result<TokenData> {
        if tokens.is_empty() {
            return Err(Error::Empty {
                what: "the token stream".into(),
            });
        }
        if vocab == 0 {
            return Err(Error::TooFew {
                what: "vocabulary size".into(),
                got: 0,
                need: 1,
            });
        }
        if vocab > 1 << 31 {
            return Err(Error::TooLarge {
                what: "vocabulary size (ids are handed out as i32)".into(),
                requested: vocab as u128,
                limit: 1 << 31,
            });
        }
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(Error::BadValue {
                what: "val_fraction".into(),
                value: val_fraction,
                want: "in [0, 1)",
            });
        }
        if let Some(pos) = tokens.iter().position(|&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfRange {
                token: i64::from(tokens[pos]),
                position: pos,
                vocab,
            });
        }
        let n_val = (tokens.len() as f64 * val_fraction).round() as usize;
        let n_train = tokens.len() - n_val.min(tokens.len());
        if n_train == 0 {
            return Err(Error::Empty {
                what: format!(
                    "the training part left by val_fraction {val_fraction} of {} tokens",
                    tokens.len()
                ),
            });
        }
        let mut train = tokens;
        let val = train.split_off(n_train);
        Ok(TokenData { train, val, vocab })
    }

    /// `text` encoded by `tok`, over `tok`'s vocabulary; errors as [`Tokenizer::encode`] and
    /// [`TokenData::new`].
    pub fn from_text(text: &str, tok: &Tokenizer, val_fraction: f64) -> Result<TokenData> {
        TokenData::new(tok.encode(text)?, tok.vocab_size(), val_fraction)
    }

    /// The UTF-8 text file at `path` encoded by `tok`.
    ///
    /// Errors with [`Error::FileIo`] when the file cannot be read, [`Error::Parse`] naming the
    /// path and the byte offset of the first invalid sequence when it is not UTF-8; otherwise
    /// as [`TokenData::from_text`].
    pub fn from_file(
        path: impl AsRef<Path>,
        tok: &Tokenizer,
        val_fraction: f64,
    ) -> Result<TokenData> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::FileIo {
            during: "reading text file",
            path: path.to_path_buf(),
            source,
        })?;
        let text = std::str::from_utf8(&bytes).map_err(|e| Error::Parse {
            what: "text file",
            input: path.display().to_string(),
            expected: format!(
                "UTF-8 (an invalid byte sequence at offset {})",
                e.valid_up_to()
            ),
        })?;
        TokenData::from_text(text, tok, val_fraction)
    }

    /// [`generated_corpus`]`(bytes, seed)` under the byte tokenizer: `bytes` tokens, vocabulary
    /// 256. Errors as [`TokenData::new`] (`bytes` 0, a bad `val_fraction`).
    pub fn generated(bytes: usize, seed: u64, val_fraction: f64) -> Result<TokenData> {
        TokenData::from_text(
            &generated_corpus(bytes, seed),
            &Tokenizer::bytes(),
            val_fraction,
        )
    }

    /// The training tokens.
    pub fn train(&self) -> &[u32] {
        &self.train
    }

    /// The held-out tokens (empty for a `val_fraction` of 0).
    pub fn val(&self) -> &[u32] {
        &self.val
    }

    /// The tokens of `split`.
    pub fn split(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Number of token ids: every token is below it.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Batch `index` of `split`: `(inputs, targets)`, each `batch` rows of `seq` ids, row-major
    /// `[batch, seq]`. Row `r` is a window of `seq + 1` consecutive tokens of the split whose
    /// start is a hash of `(index, r)`, uniform over the split's windows: the inputs are its
    /// first `seq` tokens, the targets its last `seq` (the next token at each position).
    ///
    /// The same `(split, index, batch, seq)` gives the same batch on every call and every run;
    /// a window never crosses from the training part into the held-out one.
    ///
    /// Errors with [`Error::TooFew`] when `batch` or `seq` is 0 or the split has fewer than
    /// `seq + 1` tokens, and with [`Error::TooLarge`] when the batch's bytes (two
    /// `batch · seq` arrays of `i32`) overflow or exceed what the machine holds
    /// ([`crate::limits::host_limit`]), before anything is allocated.
    pub fn batch(
        &self,
        split: Split,
        index: u64,
        batch: usize,
        seq: usize,
    ) -> Result<(Vec<i32>, Vec<i32>)> {
        for (what, n) in [("rows of a batch", batch), ("tokens a row of a batch", seq)] {
            if n == 0 {
                return Err(Error::TooFew {
                    what: format!("{what} (batch {batch}, seq {seq})"),
                    got: 0,
                    need: 1,
                });
            }
        }
        let part = self.split(split);
        if part.len() <= seq {
            return Err(Error::TooFew {
                what: format!("tokens of the {split:?} split for one window of seq + 1"),
                got: part.len(),
                need: seq.saturating_add(1),
            });
        }
        let total = batch_tokens(batch, seq)?;
        // Windows start at 0..=len - seq - 1: `starts` choices.
        let starts = (part.len() - seq) as u128;
        let domain = match split {
            Split::Train => 0x0074_7261_696e,
            Split::Val => 0x76_616c,
        };
        let mut inputs = Vec::with_capacity(total);
        let mut targets = Vec::with_capacity(total);
        for row in 0..batch {
            let h = rng::derive_seed(index, domain, row as u64);
            let start = ((u128::from(h) * starts) >> 64) as usize;
            // Tokens are below vocab <= 2^31, so they fit an i32.
            let window = &part[start..start + seq + 1];
            inputs.extend(window[..seq].iter().map(|&t| t as i32));
            targets.extend(window[1..].iter().map(|&t| t as i32));
        }
        Ok((inputs, targets))
    }

    /// The batches of `split` at `indices` (each as [`TokenData::batch`]), e.g. the
    /// micro-batches of one step of gradient accumulation, with the bytes of all of them
    /// checked before the first is made (for as many batches as the iterator's size hint
    /// says; exact for ranges and maps of them).
    ///
    /// Errors as [`TokenData::batch`], and with [`Error::TooLarge`] when the batches together
    /// overflow or exceed what the machine holds ([`crate::limits::host_limit`]).
    ///
    /// ```
    /// use tidemem::data::text::{Split, TokenData};
    /// let data = TokenData::generated(5_000, 3, 0.1)?;
    /// let step = 2u64;
    /// let micro = data.batches(Split::Train, (0..4).map(|k| step * 4 + k), 2, 16)?;
    /// assert_eq!(micro.len(), 4);
    /// assert_eq!(micro[1], data.batch(Split::Train, 9, 2, 16)?);
    /// let too_many = data.batches(Split::Train, 0..u64::MAX, 2, 16);
    /// assert!(matches!(too_many, Err(tidemem::Error::TooLarge { .. })));
    /// # Ok::<(), tidemem::Error>(())
    /// ```
    pub fn batches(
        &self,
        split: Split,
        indices: impl IntoIterator<Item = u64>,
        batch: usize,
        seq: usize,
    ) -> Result<Vec<(Vec<i32>, Vec<i32>)>> {
        let indices = indices.into_iter();
        let (lo, hi) = indices.size_hint();
        let hinted = hi.unwrap_or(lo);
        batches_bytes(hinted, batch, seq)?;
        let mut out = Vec::with_capacity(hinted);
        for index in indices {
            if out.len() >= hinted {
                // more than the hint said: check as they come
                batches_bytes(out.len() + 1, batch, seq)?;
            }
            out.push(self.batch(split, index, batch, seq)?);
        }
        Ok(out)
    }
}

/// Tokens of one batch of `batch × seq` inputs, whose inputs and targets (`i32` each) fit in
/// host memory; [`Error::TooLarge`] otherwise.
fn batch_tokens(batch: usize, seq: usize) -> Result<usize> {
    let bytes = crate::limits::host_bytes(
        || format!("bytes of a batch of {batch} × {seq} tokens (inputs and targets)"),
        &[batch, seq, 2 * std::mem::size_of::<i32>()],
    )?;
    Ok(bytes / (2 * std::mem::size_of::<i32>()))
}

/// Bytes of `count` batches of `batch × seq` tokens (inputs and targets, and the two vectors
/// holding them), refused with [`Error::TooLarge`] past host memory.
fn batches_bytes(count: usize, batch: usize, seq: usize) -> Result<usize> {
    let what = || format!("bytes of {count} batches of {batch} × {seq} tokens");
    let tokens = crate::limits::host_bytes(what, &[count, batch, seq, 8])?;
    let vectors =
        crate::limits::host_bytes(what, &[count, std::mem::size_of::<(Vec<i32>, Vec<i32>)>()])?;
    let limit = crate::limits::host_limit();
    // each is at most the limit, itself at most isize::MAX: the sum fits
    let total = tokens + vectors;
    if total as u64 > limit {
        return Err(Error::TooLarge {
            what: what(),
            requested: total as u128,
            limit,
        });
    }
    Ok(total)
}

#[cfg(test)]
mod tests;
