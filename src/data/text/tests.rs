//! Tests of the tokenizers, the generated corpus and the batches.

use super::*;

#[test]
fn bytes_round_trip_including_non_ascii() {
    let tok = Tokenizer::bytes();
    assert!(tok.is_bytes());
    assert_eq!(tok.vocab_size(), 256);
    let text = "naïve café, 東京, 🦀!\n\ttab";
    let ids = tok.encode(text).unwrap();
    assert_eq!(ids.len(), text.len());
    assert!(ids.iter().all(|&id| id < 256));
    assert_eq!(tok.decode(&ids).unwrap(), text);
    // A window cut inside a character decodes lossily, not as an error.
    assert_eq!(tok.decode(&ids[..7]).unwrap(), "naïve ");
    assert_eq!(tok.decode(&ids[..3]).unwrap(), "na\u{fffd}");
    let err = tok.decode(&[104, 256]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TokenOutOfRange {
                token: 256,
                position: 1,
                vocab: 256
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("position 1"), "{err}");
}

#[test]
fn corpus_is_deterministic_ascii_and_exactly_sized() {
    for bytes in [0, 1, 37, 1000, 12_345] {
        let a = generated_corpus(bytes, 3);
        assert_eq!(a.len(), bytes);
        assert!(a.is_ascii());
        assert_eq!(a, generated_corpus(bytes, 3));
    }
    assert_ne!(generated_corpus(2000, 3), generated_corpus(2000, 4));
    let text = generated_corpus(5000, 9);
    assert!(text.starts_with("1. ") && text.contains("\n2. ") && text.contains("\n\n9. "));
}

/// Entropy in bits of a distribution given by counts.
fn entropy(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total as f64;
            -p * p.log2()
        })
        .sum()
}

#[test]
fn corpus_has_learnable_structure() {
    let text = generated_corpus(200_000, 11);
    let b = text.as_bytes();
    let mut uni = vec![0u64; 256];
    let mut bi = vec![0u64; 256 * 256];
    for w in b.windows(2) {
        uni[w[0] as usize] += 1;
        bi[w[0] as usize * 256 + w[1] as usize] += 1;
    }
    let h_uni = entropy(&uni);
    // H(next | previous) = H(previous, next) - H(previous).
    let h_cond = entropy(&bi) - h_uni;
    assert!(h_uni > 3.5, "unigram entropy {h_uni:.2} bits");
    assert!(
        h_cond < h_uni - 1.5,
        "bigram conditional entropy {h_cond:.2} vs unigram {h_uni:.2} bits"
    );
}

#[test]
fn batches_shift_by_one_repeat_and_stay_in_their_split() {
    // Distinct tokens (position % vocab over a vocab larger than the stream) locate every
    // window in the stream.
    let tokens: Vec<u32> = (0..1000).collect();
    let data = TokenData::new(tokens, 1000, 0.2).unwrap();
    assert_eq!((data.train().len(), data.val().len()), (800, 200));
    assert!(format!("{data:?}").len() < 100);
    let (batch, seq) = (16, 24);
    for split in [Split::Train, Split::Val] {
        let part = data.split(split);
        let (x, y) = data.batch(split, 5, batch, seq).unwrap();
        assert_eq!((x.len(), y.len()), (batch * seq, batch * seq));
        assert_eq!(
            data.batch(split, 5, batch, seq).unwrap(),
            (x.clone(), y.clone())
        );
        assert_ne!(data.batch(split, 6, batch, seq).unwrap().0, x);
        for r in 0..batch {
            let (xr, yr) = (&x[r * seq..(r + 1) * seq], &y[r * seq..(r + 1) * seq]);
            assert_eq!(xr[1..], yr[..seq - 1]);
            let start = part.iter().position(|&t| t as i32 == xr[0]).unwrap();
            assert!(start + seq < part.len(), "row {r} runs past its split");
            let want: Vec<i32> = part[start..=start + seq]
                .iter()
                .map(|&t| t as i32)
                .collect();
            assert_eq!(xr, &want[..seq]);
            assert_eq!(yr, &want[1..]);
        }
    }
    // Windows spread over the whole split, both ends included over many steps.
    let mut seen = vec![false; 800 - 24];
    for i in 0..2000 {
        let (x, _) = data.batch(Split::Train, i, 4, 24).unwrap();
        for r in 0..4 {
            seen[x[r * 24] as usize] = true;
        }
    }
    assert!(seen[0] && seen[800 - 25]);
    assert!(seen.iter().filter(|&&s| s).count() > 700);
    // A split of exactly seq + 1 tokens has one window.
    let data = TokenData::new((0..10).collect(), 10, 0.0).unwrap();
    let (x, y) = data.batch(Split::Train, 3, 2, 9).unwrap();
    assert_eq!(x[..9], [0, 1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(y[9..], [1, 2, 3, 4, 5, 6, 7, 8, 9]);
}

#[test]
fn bad_inputs_are_errors() {
    let bad = |r: Result<TokenData>| r.unwrap_err().to_string();
    assert!(bad(TokenData::new(vec![], 10, 0.1)).contains("empty"));
    assert!(bad(TokenData::new(vec![1], 0, 0.1)).contains("vocabulary"));
    assert!(bad(TokenData::new(vec![1], 10, 1.0)).contains("val_fraction"));
    assert!(bad(TokenData::new(vec![1], 10, f64::NAN)).contains("val_fraction"));
    assert!(matches!(
        TokenData::new(vec![1], 10, 0.6),
        Err(Error::Empty { what }) if what.contains("training part")
    ));
    assert!(matches!(
        TokenData::new(vec![1, 2, 10, 11], 10, 0.1),
        Err(Error::TokenOutOfRange {
            token: 10,
            position: 2,
            vocab: 10
        })
    ));
    let e = bad(TokenData::new(vec![1, 2, 10, 11], 10, 0.1));
    assert!(e.contains("token 10 at position 2"), "{e}");
    let data = TokenData::generated(1000, 1, 0.1).unwrap();
    assert_eq!(data.val().len(), 100);
    assert!(data.batch(Split::Train, 0, 0, 8).is_err());
    assert!(data.batch(Split::Train, 0, 8, 0).is_err());
    assert!(data.batch(Split::Train, 0, 1, 899).is_ok());
    assert!(data.batch(Split::Train, 0, 1, 900).is_err());
    let e = data.batch(Split::Val, 0, 1, 100);
    assert!(
        matches!(&e, Err(Error::TooFew { what, got: 100, need: 101 }) if what.contains("Val split")),
        "{e:?}"
    );
    assert!(data.batch(Split::Train, 0, usize::MAX, 2).is_err());
    let empty_val = TokenData::generated(100, 1, 0.0).unwrap();
    assert!(empty_val.batch(Split::Val, 0, 1, 1).is_err());

    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.txt");
    let e = TokenData::from_file(&missing, &Tokenizer::bytes(), 0.1).unwrap_err();
    assert!(
        matches!(&e, Error::FileIo { path, .. } if *path == missing),
        "{e}"
    );
    assert!(e.to_string().contains("missing.txt"), "{e}");
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"abc caf\xe9 def").unwrap();
    let e = TokenData::from_file(&latin1, &Tokenizer::bytes(), 0.1).unwrap_err();
    let e = e.to_string();
    assert!(e.contains("latin1.txt") && e.contains("offset 7"), "{e}");
    let good = dir.path().join("good.txt");
    std::fs::write(&good, "héllo wörld, 0123456789").unwrap();
    let data = TokenData::from_file(&good, &Tokenizer::bytes(), 0.25).unwrap();
    assert_eq!(data.train().len() + data.val().len(), 25);
}

#[test]
fn word_level_tokenizer_file_round_trip() {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    let words = ["[UNK]", "the", "cat", "sees", "dog", "."];
    let model = WordLevel::builder()
        .vocab(
            words
                .iter()
                .enumerate()
                .map(|(i, w)| (w.to_string(), i as u32))
                .collect(),
        )
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut hf = tokenizers::Tokenizer::new(model);
    hf.with_pre_tokenizer(Some(Whitespace));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    hf.save(&path, false).unwrap();

    let tok = Tokenizer::from_file(&path).unwrap();
    assert!(!tok.is_bytes());
    assert_eq!(tok.vocab_size(), 6);
    let ids = tok.encode("the cat sees the bird.").unwrap();
    assert_eq!(ids, [1, 2, 3, 1, 0, 5]);
    assert_eq!(
        tok.decode(&[1, 4, 3, 1, 2]).unwrap(),
        "the dog sees the cat"
    );
    assert!(tok
        .decode(&[1, 6])
        .unwrap_err()
        .to_string()
        .contains("position 1"));
    let data = TokenData::from_text("the cat sees the dog . the dog", &tok, 0.25).unwrap();
    assert_eq!(
        (data.vocab(), data.train().len(), data.val().len()),
        (6, 6, 2)
    );
}

/// GPT-2's map from bytes to printable characters, which byte-level BPE vocabularies use.
fn gpt2_byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

#[test]
fn byte_level_bpe_file_like_gpt2() {
    // A GPT-2-shaped tokenizer.json: the 256 byte characters, two merges ("Ġ" + "t",
    // "Ġt" + "h"), the ByteLevel pre-tokenizer with GPT-2's regex, and its decoder.
    let mut vocab: Vec<String> = gpt2_byte_chars().iter().map(|c| c.to_string()).collect();
    vocab.extend(["Ġt".to_string(), "Ġth".to_string()]);
    let vocab: serde_json::Map<String, serde_json::Value> = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i.into()))
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "vocab": vocab, "merges": ["Ġ t", "Ġt h"]
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();

    let tok = Tokenizer::from_file(&path).unwrap();
    assert_eq!(tok.vocab_size(), 258);
    let text = "a the  thé\n\nend";
    let ids = tok.encode(text).unwrap();
    assert!(ids.contains(&257), "{ids:?}"); // " th" merged
    assert_eq!(tok.decode(&ids).unwrap(), text);
    let data = TokenData::from_text(&generated_corpus(3000, 1), &tok, 0.1).unwrap();
    assert!(data.train().len() < 2700 && data.vocab() == 258);
}

#[test]
fn unreadable_tokenizer_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let e = Tokenizer::from_file(&missing).unwrap_err();
    assert!(
        matches!(&e, Error::FileIo { path, .. } if *path == missing),
        "{e}"
    );
    assert!(e.to_string().contains("nope.json"));
    for (name, body) in [
        ("garbage.json", "this is not json {"),
        ("wrong.json", "{\"model\": 3}"),
        ("empty.json", ""),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, body).unwrap();
        let e = Tokenizer::from_file(&path).unwrap_err();
        assert!(e.to_string().contains(name), "{e}");
    }
}

#[test]
fn batches_past_host_memory_are_refused_before_allocating() {
    let data = TokenData::generated(1000, 1, 0.1).unwrap();
    let limit = crate::limits::host_limit() as usize;
    // each of the two arrays alone is more than the machine holds
    let rows = limit / 4 + 1;
    match data.batch(Split::Train, 0, rows, 1) {
        Err(Error::TooLarge {
            what,
            requested,
            limit: l,
        }) => {
            assert_eq!((requested, l), (rows as u128 * 8, limit as u64));
            assert!(what.contains(&format!("{rows} × 1 tokens")), "{what}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        data.batch(Split::Train, 0, usize::MAX, 2),
        Err(Error::TooLarge {
            requested,
            ..
        }) if requested == usize::MAX as u128 * 16
    ));
    // many micro-batches of a fine size are too many together
    let count = limit / (8 * 16 * 8) + 1;
    let r = data.batches(Split::Train, (0..count as u64).map(|k| k * 3), 8, 16);
    assert!(matches!(r, Err(Error::TooLarge { .. })), "{r:?}");
    let few = data.batches(Split::Train, [4, 7, 9], 8, 16).unwrap();
    assert_eq!(few.len(), 3);
    assert_eq!(few[1], data.batch(Split::Train, 7, 8, 16).unwrap());
    assert!(data.batches(Split::Train, [1], 0, 16).is_err());
}
