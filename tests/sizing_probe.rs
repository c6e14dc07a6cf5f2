//! `ChunkManager::probe` sizes a model of one's own: the smallest device it reports trains
//! (below what the model needs resident, so it evicts, with a roomy device's results bit for
//! bit), and one 5% smaller fails with `BudgetExceeded` naming the fetch that no longer fits.

mod common;

use tidemem::nn::{Act, CrossEntropyLoss, Gelu, Linear, Sequential};
use tidemem::optim::ScalerConfig;
use tidemem::prelude::*;
use tidemem::tide::Sizing;

const INPUTS: usize = 48;
const HIDDEN: usize = 96;
const CLASSES: usize = 10;
const ROWS: usize = 16;

fn register(m: &mut ChunkManager) -> Result<Sequential> {
    Ok(Sequential::new()
        .push(Linear::register(m, "fc1", INPUTS, HIDDEN, true, None)?)
        .push(Gelu)
        .push(Linear::register(m, "fc2", HIDDEN, HIDDEN, true, None)?)
        .push(Gelu)
        .push(Linear::register(m, "fc3", HIDDEN, CLASSES, true, None)?))
}

fn config() -> ManagerConfig {
    let mut cfg = ManagerConfig::new(HIDDEN * HIDDEN + HIDDEN, Policy::Tide);
    cfg.param_dtype = DType::F16;
    cfg
}

fn adam() -> Result<HybridAdam> {
    let mut cfg = HybridConfig::new(AdamConfig::adam(1e-3));
    cfg.loss_scale = Some(ScalerConfig::default());
    HybridAdam::new(cfg)
}

fn step(m: &mut ChunkManager, model: &Sequential, opt: &mut HybridAdam, k: usize) -> Result<f32> {
    let x: Vec<f32> = (0..ROWS * INPUTS)
        .map(|i| ((i * 31 + k * 7) % 23) as f32 / 11.5 - 1.0)
        .collect();
    let y: Vec<i32> = (0..ROWS).map(|r| ((r + k) % CLASSES) as i32).collect();
    let fwd = m.forward()?;
    let xa = Act::upload(fwd.pool(), fwd.stream(), ROWS, INPUTS, DType::F16, &x)?;
    let (logits, saved) = model.forward(&fwd, &xa)?;
    let (loss, dlogits) = CrossEntropyLoss::new(CLASSES)?.forward(&fwd, opt, logits, &y)?;
    fwd.finish()?;
    let bwd = m.backward()?;
    model.backward(&bwd, saved, &dlogits, false)?;
    bwd.finish()?;
    m.step(opt)?;
    loss.read()
}

/// Three steps on a device of `capacity` bytes configured from `sizing`: the losses' bits and
/// the chunk moves.
fn train(sizing: &Sizing, capacity: u64) -> Result<(Vec<u32>, tidemem::tide::MoveStats)> {
    let dev = Device::sim(SimConfig::with_capacity(capacity as usize))?;
    let mut cfg = config();
    cfg.scheduler = sizing.config_for(capacity);
    let mut m = ChunkManager::new(dev, cfg)?;
    let model = register(&mut m)?;
    let mut opt = adam()?;
    let losses = (0..3)
        .map(|k| step(&mut m, &model, &mut opt, k).map(f32::to_bits))
        .collect::<Result<_>>()?;
    Ok((losses, m.stats()))
}

#[test]
fn the_smallest_device_trains_and_one_five_percent_smaller_names_the_fetch() {
    let roomy = Device::sim(SimConfig::with_capacity(1 << 40)).unwrap();
    let sizing = ChunkManager::probe(roomy, config(), register, |m, model| {
        step(m, model, &mut adam()?, 0).map(drop)
    })
    .unwrap();
    let smallest = sizing
        .smallest_device(Policy::Tide, |c| sizing.config_for(c))
        .unwrap();
    // less than the model needs resident (its activations' peak and every parameter chunk):
    // the device must evict, and trains to a roomy device's bits
    let resident = sizing.non_model_peak() + sizing.device_chunk_bytes();
    assert!(smallest < resident, "{smallest} bytes, {resident} resident");
    assert!(smallest >= sizing.largest_moment());
    let (losses, moved) = train(&sizing, smallest).unwrap();
    let (roomy_losses, roomy_moved) = train(&sizing, 4 * resident).unwrap();
    assert!(
        losses.iter().all(|&l| f32::from_bits(l).is_finite()),
        "{losses:?}"
    );
    assert_eq!(
        losses, roomy_losses,
        "the smallest device's losses are a roomy one's"
    );
    // (the parameters go up after every host step on either device: an eviction here costs a
    // write-back or a drop, not a second upload)
    let (e, r) = (common::evictions(&moved), common::evictions(&roomy_moved));
    assert!(
        e > r,
        "the smallest device evicts: {e} chunks, a roomy one {r}"
    );

    let smaller = smallest * 95 / 100;
    match train(&sizing, smaller) {
        Err(e @ Error::BudgetExceeded { .. }) => {
            let Error::BudgetExceeded {
                tensors, chunks, ..
            } = &e
            else {
                unreachable!()
            };
            assert!(!tensors.is_empty() && !chunks.is_empty(), "{e}");
            let msg = e.to_string();
            println!(
                "{} bytes of model data; smallest device {smallest}; at {smaller}: {msg}",
                sizing.model_data_bytes()
            );
            assert!(msg.contains(&tensors[0]), "{msg}");
        }
        other => panic!("a device of {smaller} bytes: {other:?}"),
    }
}
