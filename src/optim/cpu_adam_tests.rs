//! The CPU Adam's paths against each other and against the f64 reference step.

use half::{bf16, f16};

use super::adam::{reference_step, AdamConfig};
use crate::ops::grad_stats::grad_stats_host as grad_stats;
use crate::ops::{CpuAdam, Grad, GradInPlace, Isa, ParamCopy};

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn paths() -> Vec<CpuAdam> {
    Isa::ALL
        .into_iter()
        .filter_map(|i| match CpuAdam::new().with_isa(i) {
            Ok(a) => Some(a.with_threads(1)),
            Err(_) => {
                eprintln!("skipping the {} path: not supported by this CPU", i.name());
                None
            }
        })
        .collect()
}

#[test]
fn every_path_matches_the_f64_reference_over_100_steps() {
    for cfg in [
        AdamConfig::adam(1e-3),
        AdamConfig {
            weight_decay: 0.05,
            ..AdamConfig::adam(1e-3)
        },
        AdamConfig::adamw(1e-3, 0.1),
        AdamConfig {
            bias_correction: false,
            ..AdamConfig::adamw(3e-3, 0.01)
        },
    ] {
        for adam in paths() {
            let mut worst = 0f64;
            for n in [1usize, 7, 16, 33, 257] {
                // offset by one element: unaligned starts
                let mut seed = n as u64;
                let mut p = vec![0f32; n + 1];
                p.iter_mut().for_each(|x| *x = lcg(&mut seed));
                let mut m = vec![0f32; n + 1];
                let mut v = vec![0f32; n + 1];
                let mut rp: Vec<f64> = p[1..].iter().map(|&x| x as f64).collect();
                let (mut rm, mut rv) = (vec![0f64; n], vec![0f64; n]);
                for step in 1..=100u64 {
                    let g: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 4.0).collect();
                    let gs = 0.5f32;
                    let s = cfg.scalars(step, gs).unwrap();
                    adam.step(
                        &s,
                        &mut p[1..],
                        &mut m[1..],
                        &mut v[1..],
                        Grad::F32(&g),
                        ParamCopy::None,
                    )
                    .unwrap();
                    let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                    reference_step(&cfg, step, gs as f64, &mut rp, &mut rm, &mut rv, &g64).unwrap();
                }
                // norm-wise relative error ≤ 1e-6; no element further than a few f32
                // roundings per step (p is rounded once per step, 100 times)
                let (mut num, mut den) = (0f64, 0f64);
                for i in 0..n {
                    let (a, b) = (p[i + 1] as f64, rp[i]);
                    num += (a - b).powi(2);
                    den += b * b;
                    assert!(
                        (a - b).abs() <= 4e-6 * b.abs().max(1e-2),
                        "{} n={n} i={i}: {a} vs {b} ({cfg:?})",
                        adam.isa().name()
                    );
                }
                let rel = (num / den).sqrt();
                worst = worst.max(rel);
                assert!(
                    rel <= 1e-6,
                    "{} n={n}: relative error {rel:e}",
                    adam.isa().name()
                );
            }
            eprintln!(
                "{}: worst norm-wise relative error {worst:.2e}",
                adam.isa().name()
            );
        }
    }
}

#[test]
fn half_gradients_and_fused_copies_match_the_scalar_path() {
    let cfg = AdamConfig::adamw(1e-3, 0.01);
    let s = cfg.scalars(3, 1.0 / 256.0).unwrap();
    let n = 1000 + 13;
    let mut seed = 9;
    let p0: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
    let g32: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 300.0).collect();
    for adam in paths() {
        // fp16 grads, fp16 copy; bf16 grads in place
        let g16: Vec<f16> = g32.iter().map(|&x| f16::from_f32(x)).collect();
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
        let mut c16 = vec![f16::ZERO; n];
        adam.step(
            &s,
            &mut p,
            &mut m,
            &mut v,
            Grad::F16(&g16),
            ParamCopy::F16(&mut c16),
        )
        .unwrap();
        // the same step through f32 gradients gives the same state
        let gw: Vec<f32> = g16.iter().map(|x| x.to_f32()).collect();
        let (mut q, mut qm, mut qv) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
        adam.step(
            &s,
            &mut q,
            &mut qm,
            &mut qv,
            Grad::F32(&gw),
            ParamCopy::None,
        )
        .unwrap();
        assert_eq!(p, q);
        assert_eq!((&m, &v), (&qm, &qv));
        for i in 0..n {
            assert_eq!(
                c16[i],
                f16::from_f32(p[i]),
                "{} f16 copy at {i}",
                adam.isa().name()
            );
        }
        let mut gb: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
        let gbw: Vec<f32> = gb.iter().map(|x| x.to_f32()).collect();
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
        adam.step_in_place(&s, &mut p, &mut m, &mut v, GradInPlace::Bf16(&mut gb))
            .unwrap();
        let (mut q, mut qm, mut qv) = (p0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
        adam.step(
            &s,
            &mut q,
            &mut qm,
            &mut qv,
            Grad::F32(&gbw),
            ParamCopy::None,
        )
        .unwrap();
        assert_eq!(p, q);
        for i in 0..n {
            assert_eq!(
                gb[i],
                bf16::from_f32(p[i]),
                "{} bf16 copy at {i}",
                adam.isa().name()
            );
        }
    }
}

#[test]
fn every_path_agrees_bitwise_and_threads_do_not_change_results() {
    let cfg = AdamConfig::adam(1e-3);
    let s = cfg.scalars(1, 1.0).unwrap();
    let n = (1 << 18) + 5;
    let mut seed = 1;
    let p0: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
    let g: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
    let run = |a: CpuAdam| {
        let (mut p, mut m, mut v) = (p0.clone(), vec![0f32; n], vec![0f32; n]);
        a.step(&s, &mut p, &mut m, &mut v, Grad::F32(&g), ParamCopy::None)
            .unwrap();
        (p, m, v)
    };
    let all = paths();
    for a in &all {
        assert_eq!(run(*a), run(a.with_threads(3)), "{}", a.isa().name());
        assert_eq!(
            run(*a),
            run(all[0]),
            "{} against {}",
            a.isa().name(),
            all[0].isa().name()
        );
    }
}

#[test]
fn mismatched_lengths_and_unsupported_paths_are_errors() {
    let s = AdamConfig::adam(1e-3).scalars(1, 1.0).unwrap();
    let (mut p, mut m, mut v) = (vec![0f32; 4], vec![0f32; 4], vec![0f32; 3]);
    let a = CpuAdam::new();
    assert!(a
        .step(
            &s,
            &mut p,
            &mut m,
            &mut v,
            Grad::F32(&[0.0; 4]),
            ParamCopy::None
        )
        .is_err());
    let mut v = vec![0f32; 4];
    let mut c = vec![f16::ZERO; 5];
    assert!(a
        .step(
            &s,
            &mut p,
            &mut m,
            &mut v,
            Grad::F32(&[0.0; 4]),
            ParamCopy::F16(&mut c)
        )
        .is_err());
    for i in Isa::ALL {
        assert_eq!(CpuAdam::new().with_isa(i).is_ok(), i.is_supported());
    }
    assert!(Isa::parse("sse9").is_err());
    assert_eq!(Isa::parse("avx2").unwrap(), Isa::Avx2);
}

#[test]
fn grad_stats_sum_squares_and_flag_overflow() {
    let g: Vec<f16> = (0..1000).map(|i| f16::from_f32(i as f32 / 100.0)).collect();
    let st = grad_stats(Grad::F16(&g));
    let want: f64 = g.iter().map(|x| (x.to_f32() as f64).powi(2)).sum();
    assert!((st.sum_sq - want).abs() <= 1e-9 * want);
    assert!(!st.nonfinite);
    let mut g = g;
    g[777] = f16::INFINITY;
    assert!(grad_stats(Grad::F16(&g)).nonfinite);
    g[777] = f16::NAN;
    assert!(grad_stats(Grad::F16(&g)).nonfinite);
}
