//! Bad input to the vocab-parallel ops: ids out of range (an error of the simulated device and
//! of the twin, NaN on CUDA), shapes, types, shards and overlaps refused with a typed error
//! before anything is written.

use super::*;
use tidemem::device::{HostOperand, Operand, TwinArgs};
use tidemem::Error;

#[test]
fn a_token_out_of_range_is_an_error_on_the_simulator_and_nan_on_cuda() {
    let sh = VocabShard::new(6, 2, 3).unwrap();
    assert!(matches!(
        VocabPlan::new(&[0, 6], &sh),
        Err(Error::TokenOutOfRange {
            token: 6,
            position: 1,
            vocab: 6
        })
    ));
    let tok = [3i32, 6, 0, 4];
    for dev in common::devices("vocab embedding bad token") {
        let s = dev.new_stream().unwrap();
        let tb = up(&dev, &s, pod(&tok));
        let table = upv(&dev, &s, &[1.0, 2.0, 3.0], DType::F32);
        let out = up(&dev, &s, &[0x5a; 16]);
        vocab_embedding_forward(&dev, &s, &tb, &table, &out, &sh, 1, DType::F32).unwrap();
        if ran_past_bad_index(&dev, &s, "token 6 at position 1") {
            let o = downv(&dev, &s, &out, DType::F32);
            assert!(o[1].is_nan(), "{o:?}");
            assert_eq!([o[0], o[2], o[3]], [2.0, 0.0, 3.0]);
        }
    }
    // The twin checks every token before it writes.
    let tok_b = pod(&tok).to_vec();
    let table = enc(&[1.0; 3], DType::F32);
    let mut out = vec![0x5au8; 16];
    let p = VocabEmbeddingParams {
        n: 4,
        c: 1,
        rows: 3,
        start: 2,
        vocab: 6,
    };
    let ops = vec![
        HostOperand::Read(&tok_b, DType::I32),
        HostOperand::Read(&table, DType::F32),
        HostOperand::Write(&mut out, DType::F32),
    ];
    let desc = &VOCAB_EMBEDDING_FORWARD;
    let mut args = TwinArgs::new(desc, ops, bytemuck::bytes_of(&p)).unwrap();
    assert!(matches!(
        (desc.twin)(&mut args),
        Err(Error::Operands { op, .. }) if op == desc.name
    ));
    assert_eq!(out, vec![0x5a; 16]);
}

#[test]
fn a_malformed_plan_is_refused_by_the_twin_before_it_writes() {
    // Tokens [3, 4, 3, 0] of the shard 2..5: rows [1, 2], starts [0, 2, 3], entries [0, 2, 1].
    let sh = VocabShard::new(6, 2, 3).unwrap();
    let good = VocabPlan::new(&[3, 4, 3, 0], &sh).unwrap().to_words();
    assert_eq!(good, [1, 2, 0, 2, 3, 0, 2, 1]);
    let dout = enc(&[1.0; 4], DType::F32);
    let p = VocabEmbeddingBackwardParams {
        n: 4,
        c: 1,
        rows: 3,
        distinct: 2,
        owned: 3,
        accumulate: 0,
        pad: 0,
    };
    // A repeated row, a row out of range, decreasing starts, starts past the entries, a
    // position out of range.
    for (i, w) in [(0usize, 2u32), (1, 3), (3, 4), (4, 4), (7, 4)] {
        let mut plan = good.clone();
        plan[i] = w;
        let words = pod(&plan).to_vec();
        let mut dtable = vec![7u8; 12];
        let ops = vec![
            HostOperand::Read(&dout, DType::F32),
            HostOperand::Read(&words, DType::U32),
            HostOperand::Write(&mut dtable, DType::F32),
        ];
        let desc = &VOCAB_EMBEDDING_BACKWARD;
        let mut args = TwinArgs::new(desc, ops, bytemuck::bytes_of(&p)).unwrap();
        let r = (desc.twin)(&mut args);
        assert!(
            matches!(r, Err(Error::Operands { op, .. }) if op == desc.name),
            "{plan:?}: {r:?}"
        );
        assert_eq!(dtable, vec![7u8; 12], "{plan:?}");
    }
}

#[test]
fn embedding_bad_shapes_are_typed_errors_and_nothing_is_written() {
    let f = DType::F32;
    let (sh, c) = (VocabShard::new(10, 4, 3).unwrap(), 2usize);
    let tok = [4i32, 9, 6, 5];
    let plan = VocabPlan::new(&tok, &sh).unwrap();
    for dev in common::devices("vocab embedding bad input") {
        let s = dev.new_stream().unwrap();
        let tb = up(&dev, &s, pod(&tok));
        let table = up(&dev, &s, &[0u8; 24]);
        let out = up(&dev, &s, &[0x11; 32]);
        let pw = up(&dev, &s, pod(&plan.to_words()));
        let dout = up(&dev, &s, &[0u8; 32]);
        let dt = up(&dev, &s, &[0x22; 24]);
        let fwd = |tok, table, out, sh: &VocabShard, c, d| {
            vocab_embedding_forward(&dev, &s, tok, table, out, sh, c, d)
        };
        let outs = [&out, &dt];
        let run =
            |what: &str, f: &dyn Fn() -> tidemem::Result<()>| refused_run(&dev, &s, what, &outs, f);
        invalid(
            fwd(&tb, table.view(0, 20).unwrap(), (&out).into(), &sh, c, f),
            &["`table`", "[V_r, C] = [3, 2]"],
        );
        invalid(
            fwd(&tb, (&table).into(), out.view(0, 24).unwrap(), &sh, c, f),
            &["`out`", "[N, C] = [4, 2]"],
        );
        invalid(
            fwd(&tb, (&table).into(), (&out).into(), &sh, 0, f),
            &["C ≥ 1"],
        );
        let beyond = VocabShard { start: 8, ..sh };
        invalid(
            fwd(&tb, (&table).into(), (&out).into(), &beyond, c, f),
            &["start + V_r ≤ V"],
        );
        let other = VocabShard { rows: 4, ..sh };
        run("table of another shard", &|| {
            fwd(&tb, (&table).into(), (&out).into(), &other, c, f)
        });
        run("out inside the table", &|| {
            fwd(&tb, (&dt).into(), dt.view(0, 16).unwrap(), &sh, 1, f)
        });
        // A direct launch: `out` of another type, tokens of another type.
        let p = VocabEmbeddingParams {
            n: 4,
            c: c as u64,
            rows: 3,
            start: 4,
            vocab: 10,
        };
        let launch = |tok_t, out_t| {
            let ops = [
                Some(Operand::new(&tb, tok_t)),
                Some(Operand::new(&table, f)),
                Some(Operand::new(out.view(0, 16).unwrap(), out_t)),
            ];
            dev.launch(&s, &VOCAB_EMBEDDING_FORWARD, &ops, bytemuck::bytes_of(&p))
        };
        invalid(launch(DType::I32, DType::F16), &["`out`"]);
        assert!(matches!(launch(DType::U32, f), Err(Error::Launch { .. })));
        // Backward: dout of other positions, a short plan, a gradient of another shard.
        let bwd = |dout, pw, dt, c, acc| {
            vocab_embedding_backward(&dev, &s, dout, &plan, pw, dt, c, acc, f)
        };
        invalid(
            bwd(
                dout.view(0, 24).unwrap(),
                (&pw).into(),
                (&dt).into(),
                c,
                false,
            ),
            &["`dout`", "[N, C] = [4, 2]"],
        );
        invalid(
            bwd(
                (&dout).into(),
                pw.view(0, 4).unwrap(),
                (&dt).into(),
                c,
                true,
            ),
            &["`plan`", "2·U + 1 + M"],
        );
        invalid(
            bwd(
                (&dout).into(),
                (&pw).into(),
                dt.view(0, 16).unwrap(),
                c,
                false,
            ),
            &["`dtable`", "[V_r, C] = [3, 2]"],
        );
        run("no channels", &|| {
            bwd((&dout).into(), (&pw).into(), (&dt).into(), 0, false)
        });
        dev.sync_stream(&s).unwrap();
        assert_eq!(down(&dev, &s, &out), vec![0x11; 32]);
        assert_eq!(down(&dev, &s, &dt), vec![0x22; 24]);
    }
}

/// The cross-entropy steps' operands for `n` rows of the shard `sh` (each row `vp` wide).
struct CeBufs {
    logits: DeviceBuffer,
    targets: DeviceBuffer,
    stat: DeviceBuffer,
    sum: DeviceBuffer,
    pred: DeviceBuffer,
    loss: DeviceBuffer,
}

impl CeBufs {
    fn new(dev: &Device, s: &Stream, t: &[i32], vp: usize) -> CeBufs {
        let n = t.len();
        let x: Vec<f64> = (0..n * vp).map(|i| (i % 7) as f64 * 0.5).collect();
        CeBufs {
            logits: upv(dev, s, &x, DType::F32),
            targets: up(dev, s, pod(t)),
            stat: upv(dev, s, &vec![3.0; n], DType::F32),
            sum: up(dev, s, &vec![0x33; n * 4]),
            pred: up(dev, s, &vec![0x44; n * 4]),
            loss: up(dev, s, &vec![0x55; n * 4]),
        }
    }

    fn sums(&self) -> VocabCeSums<'_> {
        VocabCeSums {
            logits: (&self.logits).into(),
            targets: (&self.targets).into(),
            global_max: (&self.stat).into(),
            sum_exp: (&self.sum).into(),
            target_logit: (&self.pred).into(),
        }
    }

    fn grad(&self) -> VocabCeGrad<'_> {
        VocabCeGrad {
            logits: (&self.logits).into(),
            targets: (&self.targets).into(),
            global_max: (&self.stat).into(),
            global_sum: (&self.stat).into(),
            global_target: Some((&self.stat).into()),
            losses: Some((&self.loss).into()),
        }
    }
}

#[test]
fn a_target_out_of_range_is_an_error_on_the_simulator_and_nan_on_cuda() {
    let ce = VocabCrossEntropy::new(VocabShard::new(9, 3, 4).unwrap(), IGNORE, 1.0);
    let t = [4i32, 9, IGNORE, 0];
    for dev in common::devices("vocab cross-entropy bad target") {
        // A failed step fails its stream on the simulator: each step gets its own.
        let s = dev.new_stream().unwrap();
        let b = CeBufs::new(&dev, &s, &t, 4);
        vocab_ce_sums(&dev, &s, b.sums(), &ce, DType::F32).unwrap();
        if ran_past_bad_index(&dev, &s, "target 9 of row 1") {
            let (sum, pred) = (f32s(&dev, &s, &b.sum), f32s(&dev, &s, &b.pred));
            assert!(sum[1].is_nan() && pred[1].is_nan(), "{sum:?} {pred:?}");
            assert!(sum[0] > 0.0 && pred[0].is_finite() && pred[3] == 0.0);
            assert_eq!((sum[2], pred[2]), (0.0, 0.0));
        }
        let s = dev.new_stream().unwrap();
        let b = CeBufs::new(&dev, &s, &t, 4);
        vocab_ce_grad(&dev, &s, b.grad(), &ce, DType::F32).unwrap();
        if ran_past_bad_index(&dev, &s, "target 9 of row 1") {
            let (g, l) = (f32s(&dev, &s, &b.logits), f32s(&dev, &s, &b.loss));
            assert!(l[1].is_nan() && l[2] == 0.0 && l[0].is_finite(), "{l:?}");
            assert!(g[4..8].iter().all(|x| x.is_nan()) && g[8..12] == [0.0; 4]);
            assert!(g[..4].iter().chain(&g[12..]).all(|x| x.is_finite()));
        }
    }
    // The twins check every target before they write.
    let p = VocabCeParams {
        n: 4,
        rows: 4,
        stride: 4,
        start: 3,
        vocab: 9,
        ignore_index: IGNORE,
        grad_scale: 1.0,
    };
    let (targets, stat) = (pod(&t).to_vec(), enc(&[3.0; 4], DType::F32));
    let x = enc(&[0.5; 16], DType::F32);
    let (mut sum, mut pred) = (vec![0x33u8; 16], vec![0x44u8; 16]);
    let ops = vec![
        HostOperand::Read(&x, DType::F32),
        HostOperand::Read(&targets, DType::I32),
        HostOperand::Read(&stat, DType::F32),
        HostOperand::Write(&mut sum, DType::F32),
        HostOperand::Write(&mut pred, DType::F32),
    ];
    let mut args = TwinArgs::new(&VOCAB_CE_SUMS, ops, bytemuck::bytes_of(&p)).unwrap();
    assert!(matches!(
        (VOCAB_CE_SUMS.twin)(&mut args),
        Err(Error::Operands { op, .. }) if op == VOCAB_CE_SUMS.name
    ));
    assert_eq!((sum, pred), (vec![0x33; 16], vec![0x44; 16]));
    let (mut logits, mut loss) = (x.clone(), vec![0x55u8; 16]);
    let ops = vec![
        HostOperand::Write(&mut logits, DType::F32),
        HostOperand::Read(&targets, DType::I32),
        HostOperand::Read(&stat, DType::F32),
        HostOperand::Read(&stat, DType::F32),
        HostOperand::Read(&stat, DType::F32),
        HostOperand::Write(&mut loss, DType::F32),
    ];
    let mut args = TwinArgs::new(&VOCAB_CE_GRAD, ops, bytemuck::bytes_of(&p)).unwrap();
    assert!(matches!(
        (VOCAB_CE_GRAD.twin)(&mut args),
        Err(Error::Operands { op, .. }) if op == VOCAB_CE_GRAD.name
    ));
    assert_eq!((logits, loss), (x, vec![0x55; 16]));
}

#[test]
fn cross_entropy_bad_shapes_are_typed_errors_and_nothing_is_written() {
    let f = DType::F32;
    let ce = VocabCrossEntropy {
        padded_rows: 5,
        ..VocabCrossEntropy::new(VocabShard::new(9, 3, 4).unwrap(), IGNORE, 1.0)
    };
    let t = [4i32, 8, IGNORE];
    for dev in common::devices("vocab cross-entropy bad input") {
        let s = dev.new_stream().unwrap();
        let b = CeBufs::new(&dev, &s, &t, 5);
        let outs = [&b.logits, &b.sum, &b.pred, &b.loss];
        let bad = |what: &str, names: &[&str], f: &dyn Fn() -> tidemem::Result<()>| {
            refused_run(&dev, &s, what, &outs, f);
            invalid(f(), names);
        };
        // Shards and padding.
        let wide = VocabCrossEntropy {
            padded_rows: 6,
            ..ce
        };
        let narrow = VocabCrossEntropy {
            padded_rows: 3,
            ..ce
        };
        let beyond = VocabCrossEntropy {
            shard: VocabShard {
                start: 6,
                ..ce.shard
            },
            ..ce
        };
        bad(
            "logits of another padding",
            &["`logits`", "[N, Vp] = [3, 6]"],
            &|| vocab_ce_grad(&dev, &s, b.grad(), &wide, f),
        );
        bad("padding narrower than the shard", &["Vp ≥ V_r"], &|| {
            vocab_ce_sums(&dev, &s, b.sums(), &narrow, f)
        });
        bad(
            "a shard past the vocabulary",
            &["start + V_r ≤ V"],
            &|| vocab_ce_max(&dev, &s, &b.logits, &b.sum, &beyond, f),
        );
        // Statistics of the wrong length.
        bad("row maxima one short", &["`logits`"], &|| {
            vocab_ce_max(&dev, &s, &b.logits, b.sum.view(0, 8).unwrap(), &ce, f)
        });
        bad("sums one short", &["`sum_exp`", "[N] = [3]"], &|| {
            let ops = VocabCeSums {
                sum_exp: b.sum.view(0, 8).unwrap(),
                ..b.sums()
            };
            vocab_ce_sums(&dev, &s, ops, &ce, f)
        });
        bad("global maxima one short", &["`global_max`"], &|| {
            let ops = VocabCeGrad {
                global_max: b.stat.view(0, 8).unwrap().into(),
                ..b.grad()
            };
            vocab_ce_grad(&dev, &s, ops, &ce, f)
        });
        // The losses without the target logits, and inside the logits.
        bad("losses alone", &["`global_target`", "`losses`"], &|| {
            let ops = VocabCeGrad {
                global_target: None,
                ..b.grad()
            };
            vocab_ce_grad(&dev, &s, ops, &ce, f)
        });
        bad("losses inside the logits", &["overlaps"], &|| {
            let ops = VocabCeGrad {
                losses: Some(b.logits.view(0, 12).unwrap()),
                ..b.grad()
            };
            vocab_ce_grad(&dev, &s, ops, &ce, f)
        });
        // A direct launch with targets of another type.
        let ops = [
            Some(Operand::new(&b.logits, f)),
            Some(Operand::new(&b.targets, DType::U32)),
            Some(Operand::new(&b.stat, f)),
            Some(Operand::new(&b.sum, f)),
            Some(Operand::new(&b.pred, f)),
        ];
        let p = VocabCeParams {
            n: 3,
            rows: 4,
            stride: 5,
            start: 3,
            vocab: 9,
            ignore_index: IGNORE,
            grad_scale: 1.0,
        };
        let r = dev.launch(&s, &VOCAB_CE_SUMS, &ops, bytemuck::bytes_of(&p));
        assert!(matches!(r, Err(Error::Launch { .. })), "{r:?}");
        // What the right call writes, for contrast.
        vocab_ce_sums(&dev, &s, b.sums(), &ce, f).unwrap();
        dev.sync_stream(&s).unwrap();
        assert_ne!(down(&dev, &s, &b.sum), vec![0x33; 12]);
    }
}
