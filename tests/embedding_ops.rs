//! The device embedding kernels on every backend present (the simulated device always, CUDA
//! when a GPU is) against their CPU twins, bit for bit, and their argument checks.

mod common;
mod ops_util;

use ops_util::{up, Rng, SplitMix64};
use tidemem::device::Device;
use tidemem::ops::embedding::{
    bag_backward, bag_forward, gather_rows, plan_backward, row_step, scatter_rows, BagMode,
    EmbeddingOptimizer,
};
use tidemem::Error;

/// A random value in [-1, 1) in steps of 1/1000.
fn milli(rng: &mut SplitMix64) -> f32 {
    (rng.next_u32() % 2000) as f32 / 1000.0 - 1.0
}

/// `rows` rows of `stride` floats: weights in [-1, 1), and optimizer state (the floats past
/// `dim`: Adagrad's sum of squares, Adam's moments) in [0, 1), as a step leaves it. A negative
/// sum of squares would make the step's square root a NaN, whose bits the CPU and a GPU choose
/// differently.
fn random_table(rng: &mut SplitMix64, rows: usize, stride: usize, dim: usize) -> Vec<f32> {
    (0..rows * stride)
        .map(|i| {
            let x = milli(rng);
            if i % stride < dim {
                x
            } else {
                x.abs()
            }
        })
        .collect()
}

fn down(dev: &Device, s: &tidemem::device::Stream, b: &tidemem::device::DeviceBuffer) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(&dev.download(s, b).unwrap())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn kernels_equal_cpu_twins_bitwise() {
    let (rows, dim) = (37usize, 5usize);
    for dev in common::devices("kernels_equal_cpu_twins_bitwise") {
        let s = dev.new_stream().unwrap();
        for (mode, weighted) in [
            (BagMode::Sum, false),
            (BagMode::Mean, false),
            (BagMode::Sum, true),
        ] {
            for opt in [
                EmbeddingOptimizer::Sgd { lr: 0.3 },
                EmbeddingOptimizer::RowwiseAdagrad { lr: 0.1, eps: 1e-6 },
                EmbeddingOptimizer::Adam {
                    lr: 0.01,
                    beta1: 0.9,
                    beta2: 0.99,
                    eps: 1e-8,
                },
            ] {
                let stride = dim + opt.state_len(dim) + 1;
                let mut rng = SplitMix64::new(99);
                let table = random_table(&mut rng, rows, stride, dim);
                let mut idx = Vec::new();
                let mut off = vec![0u32];
                for b in 0..23 {
                    // Bag 3 is empty; index 40 is out of range and skipped.
                    let n = if b == 3 { 0 } else { 1 + rng.next_u32() % 5 };
                    for _ in 0..n {
                        idx.push(rng.next_u32() % (rows as u32 + 3));
                    }
                    off.push(idx.len() as u32);
                }
                let w: Vec<f32> = idx.iter().map(|_| milli(&mut rng)).collect();
                let w = weighted.then_some(w);
                let bags = off.len() - 1;
                // Forward.
                let mut out = vec![0f32; bags * dim];
                bag_forward(
                    &table,
                    stride,
                    dim,
                    &idx,
                    &off,
                    w.as_deref(),
                    mode,
                    &mut out,
                )
                .unwrap();
                let tb = up(&dev, &s, bytemuck::cast_slice(&table));
                let ib = up(&dev, &s, bytemuck::cast_slice(&idx));
                let ob = up(&dev, &s, bytemuck::cast_slice(&off));
                let wb = w.as_ref().map(|w| up(&dev, &s, bytemuck::cast_slice(w)));
                let outb = dev.alloc(bags * dim * 4).unwrap();
                tidemem::ops::embedding::device::embedding_bag(
                    &dev,
                    &s,
                    tb.view(0, tb.len()).unwrap(),
                    stride,
                    dim,
                    ib.view(0, ib.len()).unwrap(),
                    ob.view(0, ob.len()).unwrap(),
                    wb.as_ref().map(|b| b.view(0, b.len()).unwrap()),
                    mode,
                    outb.view(0, outb.len()).unwrap(),
                )
                .unwrap();
                assert_eq!(
                    bits(&out),
                    bits(&down(&dev, &s, &outb)),
                    "{} forward {mode:?}",
                    dev.name()
                );
                // Backward.
                let p = plan_backward(&idx, &off, w.as_deref(), mode).unwrap();
                let go: Vec<f32> = (0..bags * dim).map(|_| milli(&mut rng)).collect();
                let mut g = vec![0f32; p.rows.len() * dim];
                bag_backward(&go, dim, &p.row_ptr, &p.entries, &p.scale, &mut g).unwrap();
                let gob = up(&dev, &s, bytemuck::cast_slice(&go));
                let rpb = up(&dev, &s, bytemuck::cast_slice(&p.row_ptr));
                let eb = up(&dev, &s, bytemuck::cast_slice(&p.entries));
                let sb = up(&dev, &s, bytemuck::cast_slice(&p.scale));
                let gb = dev.alloc(g.len() * 4).unwrap();
                tidemem::ops::embedding::device::embedding_backward(
                    &dev,
                    &s,
                    gob.view(0, gob.len()).unwrap(),
                    dim,
                    rpb.view(0, rpb.len()).unwrap(),
                    eb.view(0, eb.len()).unwrap(),
                    sb.view(0, sb.len()).unwrap(),
                    gb.view(0, gb.len()).unwrap(),
                )
                .unwrap();
                assert_eq!(
                    bits(&g),
                    bits(&down(&dev, &s, &gb)),
                    "{} backward",
                    dev.name()
                );
                // Step on the distinct rows (out-of-range ones skipped).
                let mut t2 = table.clone();
                row_step(&mut t2, stride, dim, &p.rows, &g, &opt, 2).unwrap();
                let rb = up(&dev, &s, bytemuck::cast_slice(&p.rows));
                tidemem::ops::embedding::device::embedding_step(
                    &dev,
                    &s,
                    tb.view(0, tb.len()).unwrap(),
                    stride,
                    dim,
                    rb.view(0, rb.len()).unwrap(),
                    gb.view(0, gb.len()).unwrap(),
                    &opt,
                    2,
                )
                .unwrap();
                assert_eq!(
                    bits(&t2),
                    bits(&down(&dev, &s, &tb)),
                    "{} step {opt:?}",
                    dev.name()
                );
                // Row moves.
                let rbytes = stride * 4;
                let sel: Vec<u32> = vec![4, 0, 36, 90, 7];
                let mut packed = vec![0u8; sel.len() * rbytes];
                gather_rows(bytemuck::cast_slice(&t2), rbytes, &sel, &mut packed);
                let selb = up(&dev, &s, bytemuck::cast_slice(&sel));
                // Rows out of range are skipped, leaving the destination as it was: start it at
                // zero like the host side (fresh device memory is not zeroed on a GPU).
                let pb = up(&dev, &s, &vec![0u8; packed.len()]);
                tidemem::ops::embedding::device::gather_rows(
                    &dev,
                    &s,
                    tb.view(0, tb.len()).unwrap(),
                    rbytes,
                    selb.view(0, selb.len()).unwrap(),
                    pb.view(0, pb.len()).unwrap(),
                )
                .unwrap();
                assert_eq!(packed, dev.download(&s, &pb).unwrap());
                let mut t3 = vec![0u8; rows * rbytes];
                scatter_rows(&packed, rbytes, &sel, &mut t3);
                let t3b = up(&dev, &s, &t3);
                tidemem::ops::embedding::device::scatter_rows(
                    &dev,
                    &s,
                    pb.view(0, pb.len()).unwrap(),
                    rbytes,
                    selb.view(0, selb.len()).unwrap(),
                    t3b.view(0, t3b.len()).unwrap(),
                )
                .unwrap();
                assert_eq!(t3, dev.download(&s, &t3b).unwrap());
            }
        }
    }
}

/// More bags, distinct rows and moved rows than one CUDA grid has blocks (65,535), and rows wider
/// than a block has threads (128): the kernels' grid-stride and thread loops cover every one.
/// Scattered rows land in a table filled with a pattern, whose other bytes must stay as they
/// were, and the step leaves rows not in its list untouched.
#[test]
fn grid_stride_covers_large_batches_and_wide_rows() {
    for (bags, rows, dim) in [(70_000usize, 300_000usize, 2usize), (300, 500, 131)] {
        for dev in common::devices("grid_stride_covers_large_batches_and_wide_rows") {
            let s = dev.new_stream().unwrap();
            let opt = EmbeddingOptimizer::RowwiseAdagrad { lr: 0.1, eps: 1e-6 };
            let stride = dim + opt.state_len(dim);
            let mut rng = SplitMix64::new(7);
            let table = random_table(&mut rng, rows, stride, dim);
            let mut idx = Vec::new();
            let mut off = vec![0u32];
            for _ in 0..bags {
                for _ in 0..1 + rng.next_u32() % 2 {
                    idx.push(rng.next_u32() % rows as u32);
                }
                off.push(idx.len() as u32);
            }
            let mut out = vec![0f32; bags * dim];
            bag_forward(
                &table,
                stride,
                dim,
                &idx,
                &off,
                None,
                BagMode::Mean,
                &mut out,
            )
            .unwrap();
            let tb = up(&dev, &s, bytemuck::cast_slice(&table));
            let ib = up(&dev, &s, bytemuck::cast_slice(&idx));
            let ob = up(&dev, &s, bytemuck::cast_slice(&off));
            let outb = dev.alloc(out.len() * 4).unwrap();
            tidemem::ops::embedding::device::embedding_bag(
                &dev,
                &s,
                v(&tb),
                stride,
                dim,
                v(&ib),
                v(&ob),
                None,
                BagMode::Mean,
                v(&outb),
            )
            .unwrap();
            assert_eq!(bits(&out), bits(&down(&dev, &s, &outb)), "{}", dev.name());
            let p = plan_backward(&idx, &off, None, BagMode::Mean).unwrap();
            assert!(
                bags < 1000 || p.rows.len() > 65_535,
                "more distinct rows than blocks"
            );
            let go: Vec<f32> = (0..bags * dim).map(|_| milli(&mut rng)).collect();
            let mut g = vec![0f32; p.rows.len() * dim];
            bag_backward(&go, dim, &p.row_ptr, &p.entries, &p.scale, &mut g).unwrap();
            let gob = up(&dev, &s, bytemuck::cast_slice(&go));
            let rpb = up(&dev, &s, bytemuck::cast_slice(&p.row_ptr));
            let eb = up(&dev, &s, bytemuck::cast_slice(&p.entries));
            let sb = up(&dev, &s, bytemuck::cast_slice(&p.scale));
            let gb = dev.alloc(g.len() * 4).unwrap();
            tidemem::ops::embedding::device::embedding_backward(
                &dev,
                &s,
                v(&gob),
                dim,
                v(&rpb),
                v(&eb),
                v(&sb),
                v(&gb),
            )
            .unwrap();
            assert_eq!(bits(&g), bits(&down(&dev, &s, &gb)), "{}", dev.name());
            let mut t2 = table.clone();
            row_step(&mut t2, stride, dim, &p.rows, &g, &opt, 2).unwrap();
            let rb = up(&dev, &s, bytemuck::cast_slice(&p.rows));
            tidemem::ops::embedding::device::embedding_step(
                &dev,
                &s,
                v(&tb),
                stride,
                dim,
                v(&rb),
                v(&gb),
                &opt,
                2,
            )
            .unwrap();
            assert_eq!(bits(&t2), bits(&down(&dev, &s, &tb)), "{}", dev.name());
            // Gather every other row, scatter them into a patterned table in reverse order.
            let rbytes = stride * 4;
            let sel: Vec<u32> = (0..rows as u32).step_by(2).rev().collect();
            let mut packed = vec![0u8; sel.len() * rbytes];
            gather_rows(bytemuck::cast_slice(&t2), rbytes, &sel, &mut packed);
            let selb = up(&dev, &s, bytemuck::cast_slice(&sel));
            let pb = dev.alloc(packed.len()).unwrap();
            tidemem::ops::embedding::device::gather_rows(
                &dev,
                &s,
                v(&tb),
                rbytes,
                v(&selb),
                v(&pb),
            )
            .unwrap();
            assert_eq!(packed, dev.download(&s, &pb).unwrap(), "{}", dev.name());
            let pattern: Vec<u8> = (0..rows * rbytes).map(|i| (i % 251) as u8).collect();
            let mut t3 = pattern.clone();
            scatter_rows(&packed, rbytes, &sel, &mut t3);
            let t3b = up(&dev, &s, &pattern);
            tidemem::ops::embedding::device::scatter_rows(
                &dev,
                &s,
                v(&pb),
                rbytes,
                v(&selb),
                v(&t3b),
            )
            .unwrap();
            let got = dev.download(&s, &t3b).unwrap();
            assert_eq!(t3, got, "{}", dev.name());
            assert_eq!(
                got[rbytes..2 * rbytes],
                pattern[rbytes..2 * rbytes],
                "odd rows keep their bytes"
            );
        }
    }
}

/// Offsets and row starts already on the device cannot be checked: every backend clamps them
/// the same way (a bag's range to the indices, a row's to the entries), so a malformed batch
/// gives the same bytes on the simulated device and on a GPU, and never reads out of bounds.
#[test]
fn malformed_offsets_are_clamped_alike_on_every_device() {
    let dim = 2usize;
    let table: Vec<f32> = vec![1.0, 2.0, 10.0, 20.0, 100.0, 200.0];
    let idx: Vec<u32> = vec![0, 1, 2];
    // bag 0: 0..3; bag 1: offsets fall to 1, empty; bag 2: 1..min(9, 3)
    let off: Vec<u32> = vec![0, 3, 1, 9];
    // row 0: entries 0..2; row 1: starts fall back, empty; row 2: 1..min(7, 3)
    let row_ptr: Vec<u32> = vec![0, 2, 1, 7];
    let entries: Vec<u32> = vec![0, 2, 1];
    let scale: Vec<f32> = vec![1.0, 0.5, 2.0];
    let gout: Vec<f32> = vec![1.0, 1.0, 3.0, 3.0, 8.0, 8.0];
    for dev in common::devices("malformed_offsets_are_clamped_alike_on_every_device") {
        let s = dev.new_stream().unwrap();
        let tb = up(&dev, &s, bytemuck::cast_slice(&table));
        let ib = up(&dev, &s, bytemuck::cast_slice(&idx));
        let ob = up(&dev, &s, bytemuck::cast_slice(&off));
        let out = dev.alloc(3 * dim * 4).unwrap();
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&tb),
            dim,
            dim,
            v(&ib),
            v(&ob),
            None,
            BagMode::Sum,
            v(&out),
        )
        .unwrap();
        assert_eq!(
            down(&dev, &s, &out),
            vec![111.0, 222.0, 0.0, 0.0, 110.0, 220.0],
            "{}",
            dev.name()
        );
        let g = dev.alloc(3 * dim * 4).unwrap();
        let (gb, rb, eb, sb) = (
            up(&dev, &s, bytemuck::cast_slice(&gout)),
            up(&dev, &s, bytemuck::cast_slice(&row_ptr)),
            up(&dev, &s, bytemuck::cast_slice(&entries)),
            up(&dev, &s, bytemuck::cast_slice(&scale)),
        );
        tidemem::ops::embedding::device::embedding_backward(
            &dev,
            &s,
            v(&gb),
            dim,
            v(&rb),
            v(&eb),
            v(&sb),
            v(&g),
        )
        .unwrap();
        assert_eq!(
            down(&dev, &s, &g),
            vec![5.0, 5.0, 0.0, 0.0, 10.0, 10.0],
            "{}",
            dev.name()
        );
    }
}

/// Bags that are all empty, with their (zero) indices in an empty buffer, give zeros on every
/// device (an empty buffer has no device memory to point a kernel at).
#[test]
fn empty_bags_from_an_empty_index_buffer_give_zeros() {
    for dev in common::devices("empty_bags_from_an_empty_index_buffer_give_zeros") {
        let s = dev.new_stream().unwrap();
        let table = up(&dev, &s, bytemuck::cast_slice(&[1.0f32, 2.0, 3.0, 4.0]));
        let idx = dev.alloc(0).unwrap();
        let off = up(&dev, &s, bytemuck::cast_slice(&[0u32, 0, 0]));
        let out = up(&dev, &s, bytemuck::cast_slice(&[9.0f32; 4]));
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&table),
            2,
            2,
            v(&idx),
            v(&off),
            None,
            BagMode::Mean,
            v(&out),
        )
        .unwrap();
        assert_eq!(down(&dev, &s, &out), vec![0.0; 4], "{}", dev.name());
    }
}

fn v(b: &tidemem::device::DeviceBuffer) -> tidemem::device::DeviceView<'_> {
    b.view(0, b.len()).unwrap()
}

#[test]
fn device_checks_embedding_arguments() {
    let dev = common::sim(1 << 20);
    let s = dev.new_stream().unwrap();
    let t = dev.alloc(4 * 4 * 10).unwrap();
    let i = dev.alloc(4 * 3).unwrap();
    let o = dev.alloc(4 * 3).unwrap();
    let out = dev.alloc(4 * 4 * 2).unwrap();
    let ok = tidemem::ops::embedding::device::embedding_bag(
        &dev,
        &s,
        v(&t),
        4,
        4,
        v(&i),
        v(&o),
        None,
        BagMode::Sum,
        v(&out),
    );
    assert!(ok.is_ok());
    let bad = [
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&t),
            3,
            4,
            v(&i),
            v(&o),
            None,
            BagMode::Sum,
            v(&out),
        ),
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&t),
            4,
            0,
            v(&i),
            v(&o),
            None,
            BagMode::Sum,
            v(&out),
        ),
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&t),
            4,
            4,
            v(&i),
            v(&o),
            None,
            BagMode::Sum,
            out.view(0, 16).unwrap(),
        ),
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&t),
            4,
            4,
            v(&i),
            v(&o),
            Some(o.view(0, 8).unwrap()),
            BagMode::Sum,
            v(&out),
        ),
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&t),
            4,
            4,
            v(&i),
            v(&o),
            None,
            BagMode::Sum,
            t.view(0, 32).unwrap(),
        ),
        tidemem::ops::embedding::device::embedding_bag(
            &dev,
            &s,
            v(&t),
            4,
            4,
            i.view(1, 8).unwrap(),
            v(&o),
            None,
            BagMode::Sum,
            v(&out),
        ),
        tidemem::ops::embedding::device::gather_rows(
            &dev,
            &s,
            v(&t),
            6,
            v(&i),
            out.view(0, 18).unwrap(),
        ),
        tidemem::ops::embedding::device::gather_rows(&dev, &s, v(&t), 8, v(&i), v(&out)),
        tidemem::ops::embedding::device::embedding_step(
            &dev,
            &s,
            v(&t),
            4,
            4,
            v(&i),
            out.view(0, 16).unwrap(),
            &EmbeddingOptimizer::Sgd { lr: 1.0 },
            1,
        ),
        tidemem::ops::embedding::device::embedding_step(
            &dev,
            &s,
            v(&t),
            4,
            4,
            v(&i),
            dev.alloc(48).unwrap().view(0, 48).unwrap(),
            &EmbeddingOptimizer::RowwiseAdagrad { lr: 1.0, eps: 0.0 },
            1,
        ),
    ];
    for (k, r) in bad.into_iter().enumerate() {
        assert!(
            matches!(
                r,
                Err(Error::Misaligned { .. }
                    | Error::Length { .. }
                    | Error::TooFew { .. }
                    | Error::TooLarge { .. }
                    | Error::Empty { .. }
                    | Error::NotMultiple { .. }
                    | Error::BadOffsets { .. }
                    | Error::Operands { .. })
            ),
            "case {k}: {r:?}"
        );
    }
}
