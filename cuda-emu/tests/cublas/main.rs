//! The stand-in cuBLAS: GEMMs of every transpose, padded leading dimensions and strided batches
//! in fp32, fp16 and bf16 against an f64 reference, the reduced-precision compute types, invalid
//! arguments, faults, products that run late on their stream, and the library answering to
//! both `libcuda.so` and `libcublas.so.13`.
//!
//! Tolerance: with `u` the storage type's unit roundoff (2⁻²⁴ for fp32, 2⁻¹¹ for fp16, 2⁻⁸ for
//! bf16), each element of `C` is within
//! `(k + 3) · 2⁻²⁴ · (|alpha| Σ|a b| + |beta c|) + u · |exact| + 2⁻²⁵` of the exact product of the
//! stored (or, for the fast compute types, rounded) inputs, computed in f64. Each element is also
//! bit for bit what the documented order gives: products rounded to f32 summed over ascending k,
//! then `alpha * sum + beta * c`, rounded once to the storage type.
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use tidemem_cuda_emu::*;

#[path = "../common/mod.rs"]
mod common;
mod harness;
use common::{download, faults_in_child, ok, setup, upload, SERIAL};
use harness::*;

#[test]
fn every_transpose_with_padded_leading_dimensions() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = setup();
    let h = handle(ctx.stream);
    let mut seed = 1;
    for api in [Api::GemmEx, Api::Sgemm] {
        // CUBLAS_OP_N, CUBLAS_OP_T, and CUBLAS_OP_C (a transpose, for real types).
        for ta in 0..3 {
            for tb in 0..3 {
                let trans = [ta, tb];
                check_case(
                    &ctx,
                    h,
                    &Case {
                        trans,
                        ..Case::new(api, Ty::F32)
                    },
                    seed,
                );
                seed += 1;
            }
        }
    }
    // Leading dimensions equal to the rows; one-row and one-column products; k = 1.
    for (m, n, k) in [(1, 9, 5), (7, 1, 4), (6, 5, 1), (1, 1, 33)] {
        for trans in [[0, 0], [1, 1]] {
            let base = Case::new(Api::GemmEx, Ty::F32);
            let pad = [0; 3];
            check_case(
                &ctx,
                h,
                &Case {
                    m,
                    n,
                    k,
                    trans,
                    pad,
                    ..base
                },
                seed,
            );
            seed += 1;
        }
    }
    assert_eq!(cublasDestroy_v2(h), 0);
}

#[test]
fn strided_batches_of_each_type() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = setup();
    let h = handle(ctx.stream);
    for (seed, ty) in [Ty::F32, Ty::F16, Ty::Bf16].into_iter().enumerate() {
        let seed = seed as u64;
        for (trans, shared_b) in [([0, 0], false), ([1, 0], true), ([0, 1], false)] {
            let base = Case::new(Api::StridedEx, ty);
            let c = Case {
                batch: 3,
                trans,
                shared_b,
                ..base
            };
            check_case(&ctx, h, &c, 100 + seed);
            // One matrix through cublasGemmEx.
            let single = Case {
                api: Api::GemmEx,
                batch: 1,
                ..c
            };
            check_case(&ctx, h, &single, 200 + seed);
        }
    }
    let base = Case::new(Api::SgemmStrided, Ty::F32);
    check_case(
        &ctx,
        h,
        &Case {
            batch: 4,
            trans: [1, 1],
            ..base
        },
        300,
    );
    // A product of a few hundred per side, as a trainer runs them.
    let base = Case::new(Api::GemmEx, Ty::Bf16);
    let (m, n, k) = (192, 160, 224);
    check_case(
        &ctx,
        h,
        &Case {
            m,
            n,
            k,
            trans: [0, 1],
            ..base
        },
        400,
    );
    assert_eq!(cublasDestroy_v2(h), 0);
}

#[test]
fn beta_zero_does_not_read_c_and_alpha_scales() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = setup();
    let h = handle(ctx.stream);
    for ty in [Ty::F32, Ty::F16, Ty::Bf16] {
        let base = Case::new(Api::StridedEx, ty);
        let c = Case {
            beta: 0.0,
            nan_c: true,
            batch: 2,
            ..base
        };
        let got = check_case(&ctx, h, &c, 7);
        let mut in_c = (0..c.n).map(|j| got[c.at(2, 1, 0, j)]);
        assert!(in_c.all(f32::is_finite), "NaN in C propagated");
        // alpha = 2 doubles every element exactly.
        let one = check_case(&ctx, h, &Case { alpha: 1.0, ..c }, 7);
        let two = check_case(&ctx, h, &Case { alpha: 2.0, ..c }, 7);
        for (idx, (x, y)) in one.iter().zip(&two).enumerate() {
            if x.is_finite() {
                assert_eq!((2.0 * x).to_bits(), y.to_bits(), "{ty:?} element {idx}");
            }
        }
    }
    let s = ctx.stream;
    unsafe {
        // alpha = 0 reads neither A nor B: their NaN stays out; C = beta * C.
        let nan = upload(&[f32::NAN; 4], s);
        let c = upload(&[5f32, -0.0, 3.0, f32::NAN], s);
        let r = Raw::new(Api::Sgemm, [2, 2, 2]);
        ok(call(h, &r.scale(0.0, 1.0), [nan, nan, c]));
        let got: Vec<f32> = download(c, 4, s);
        assert_eq!(got[..3], [5.0, -0.0, 3.0]);
        assert!(got[1].is_sign_negative() && got[3].is_nan());
        ok(call(h, &r.scale(0.0, 0.5), [nan, nan, c]));
        assert_eq!(download::<f32>(c, 3, s), [2.5, -0.0, 1.5]);
        // beta = 0 too: zeros, the NaN in C gone.
        ok(call(h, &r.scale(0.0, 0.0), [nan, nan, c]));
        assert_eq!(download::<f32>(c, 4, s), [0.0; 4]);
        // k = 0: C = beta * C.
        let c2 = upload(&[4f32, 8.0], s);
        let r = Raw::new(Api::Sgemm, [1, 2, 0]).ld([1, 1, 1]);
        ok(call(h, &r.scale(1.0, 0.5), [nan, nan, c2]));
        assert_eq!(download::<f32>(c2, 2, s), [2.0, 4.0]);
        for p in [nan, c, c2] {
            ok(cuMemFreeAsync(p, s));
        }
    }
    assert_eq!(cublasDestroy_v2(h), 0);
}

#[test]
fn tf32_rounds_the_inputs_to_nearest_even() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = setup();
    let h = handle(ctx.stream);
    let s = ctx.stream;
    let e = |p: i32| 2f32.powi(p);
    // A 5 x 1 column times B = [1]: C is A as TF32 takes it (10 mantissa bits).
    let a = [
        1.0 + e(-12),             // below half an ulp: down
        1.0 + e(-11),             // a tie, to even: down
        1.0 + e(-10) + e(-11),    // a tie, to even: up
        1.0 + e(-11) + e(-12),    // above half an ulp: up (truncation would go down)
        -(1.0 + e(-10) + e(-12)), // below half, negative
    ];
    let tf = [1.0, 1.0, 1.0 + e(-9), 1.0 + e(-10), -(1.0 + e(-10))];
    unsafe {
        let (ad, bd, cd) = (upload(&a, s), upload(&[1f32], s), upload(&[0f32; 5], s));
        let r = Raw::new(Api::GemmEx, [5, 1, 1]);
        let gemm = |compute: i32| {
            ok(call(h, &r.types([CUDA_R_32F; 3], compute), [ad, bd, cd]));
            download::<f32>(cd, 5, s)
        };
        assert_eq!(gemm(COMPUTE_32F), a, "exact fp32");
        assert_eq!(gemm(COMPUTE_32F_FAST_TF32), tf);
        // B is rounded too: [1] times [1 + 2^-12].
        let sgemm = || {
            ok(call(h, &Raw::new(Api::Sgemm, [1, 1, 1]), [bd, ad, cd]));
            download::<f32>(cd, 1, s)[0]
        };
        assert_eq!(sgemm(), a[0]);
        // The TF32 math mode makes CUBLAS_COMPUTE_32F and cublasSgemm TF32; PEDANTIC stays exact.
        assert_eq!(cublasSetMathMode(h, TF32_TENSOR_OP_MATH), 0);
        let mut mode = 0;
        assert_eq!(cublasGetMathMode(h, &mut mode), 0);
        assert_eq!(mode, TF32_TENSOR_OP_MATH);
        assert_eq!(gemm(COMPUTE_32F), tf);
        assert_eq!(gemm(COMPUTE_32F_PEDANTIC), a);
        assert_eq!(sgemm(), 1.0);
        assert_eq!(cublasSetMathMode(h, 0), 0);
        for p in [ad, bd, cd] {
            ok(cuMemFreeAsync(p, s));
        }
    }
    // Random products: TF32 matches its reference bit for bit and strays from exact fp32 by
    // far more than fp32's rounding.
    let base = Case::new(Api::GemmEx, Ty::F32);
    let exact = Case {
        m: 24,
        n: 20,
        k: 64,
        ..base
    };
    let want = check_case(&ctx, h, &exact, 11);
    let compute = COMPUTE_32F_FAST_TF32;
    let fast = check_case(&ctx, h, &Case { compute, ..exact }, 11);
    let diff = want.iter().zip(&fast).map(|(x, y)| (x - y).abs());
    let worst = diff.fold(0f32, f32::max);
    assert!(worst > 1e-4, "TF32 too close to fp32: {worst}");
    for compute in [COMPUTE_32F_FAST_16F, COMPUTE_32F_FAST_16BF] {
        check_case(&ctx, h, &Case { compute, ..exact }, 12);
    }
    assert_eq!(cublasDestroy_v2(h), 0);
}

#[test]
fn invalid_arguments_enqueue_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = setup();
    let h = handle(ctx.stream);
    let s = ctx.stream;
    // Two 4 x 5 by 5 x 3 products, matrices packed one after another.
    let valid = Raw::new(Api::StridedEx, [4, 3, 5]).batch(2, [20, 15, 12]);
    let d = [40, 30, 24].map(|n| upload(&vec![1f32; n], s));
    let (t16, t32, t64) = ([CUDA_R_16F; 3], [CUDA_R_32F; 3], [CUDA_R_64F; 3]);
    let mixed = [CUDA_R_32F, CUDA_R_16F, CUDA_R_32F];
    let null_alpha = Raw {
        alpha: None,
        ..valid
    };
    let sgemm = Raw::new(Api::Sgemm, [4, 3, 5]);
    let sgemm_batched = Raw::new(Api::SgemmStrided, [4, 3, 5]);
    let cases = [
        (7, valid.mnk([-1, 3, 5]), "m < 0"),
        (7, valid.mnk([4, -1, 5]), "n < 0"),
        (7, valid.mnk([4, 3, -1]), "k < 0"),
        (7, valid.ld([3, 5, 4]), "lda < m"),
        (7, valid.trans([1, 0]), "lda < k (A transposed)"),
        (7, valid.ld([4, 4, 4]), "ldb < k"),
        (
            7,
            valid.trans([0, 1]).ld([4, 2, 4]),
            "ldb < n (B transposed)",
        ),
        (7, valid.ld([4, 5, 3]), "ldc < m"),
        (7, valid.mnk([0, 3, 5]).ld([0, 5, 1]), "lda = 0"),
        (7, valid.trans([3, 0]), "transa 3"),
        (7, valid.trans([0, -1]), "transb -1"),
        (7, valid.batch(-1, [20, 15, 12]), "batch < 0"),
        (7, null_alpha, "null alpha"),
        (
            7,
            Raw {
                alpha: None,
                ..sgemm
            },
            "null alpha (Sgemm)",
        ),
        (
            7,
            sgemm_batched.batch(-1, [20, 15, 12]),
            "batch < 0 (Sgemm)",
        ),
        (15, valid.types(mixed, COMPUTE_32F), "mixed types"),
        (15, valid.types(t16, COMPUTE_16F), "16F compute"),
        (
            15,
            valid.types(t16, COMPUTE_32F_FAST_TF32),
            "TF32 on fp16 data",
        ),
        (15, valid.types(t64, COMPUTE_64F), "fp64"),
        (15, valid.types(t32, 12345), "unknown compute type"),
        (0, valid.batch(0, [20, 15, 12]), "batch 0 does nothing"),
    ];
    unsafe {
        ok(call(h, &valid, d));
        let before: Vec<f32> = download(d[2], 24, s);
        for (status, r, what) in cases {
            assert_eq!(call(h, &r, d), status, "{what}");
            // Nothing was enqueued: the stream is idle at the first query.
            assert_eq!(cuStreamQuery(s), 0, "{what}: work was enqueued");
        }
        assert_eq!(call(8 as _, &valid, d), 1, "unknown handle");
        // m = 0 does nothing, whatever the pointers.
        let empty = Raw::new(Api::Sgemm, [0, 3, 5]).ld([1, 5, 1]);
        assert_eq!(call(h, &empty, [0; 3]), 0);
        assert_eq!(cuStreamQuery(s), 0);
        assert_eq!(download::<f32>(d[2], 24, s), before, "C changed");
    }
    assert_eq!(cublasDestroy_v2(h), 0);
}

#[test]
fn handles_keep_a_stream_and_a_math_mode() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = setup();
    unsafe {
        let mut h = null_mut();
        assert_eq!(cublasCreate_v2(&mut h), 0);
        let mut st = std::ptr::dangling_mut::<c_void>();
        assert_eq!(cublasGetStream_v2(h, &mut st), 0);
        assert!(st.is_null(), "a new handle uses the null stream");
        assert_eq!(cublasSetStream_v2(h, ctx.other), 0);
        assert_eq!(cublasGetStream_v2(h, &mut st), 0);
        assert_eq!(st, ctx.other);
        assert_eq!(cublasSetStream_v2(h, 12345 as _), 7, "not a stream");
        let mut v = 0;
        assert_eq!(cublasGetVersion_v2(h, &mut v), 0);
        assert_eq!(v / 10000, 13);
        assert_eq!(cublasSetMathMode(h, 99), 7);
        assert_eq!(cublasSetMathMode(h, TF32_TENSOR_OP_MATH | 16), 0);
        assert_eq!(cublasSetPointerMode_v2(h, 0), 0);
        assert_eq!(cublasSetPointerMode_v2(h, 1), 15, "device scalars");
        let mut pm = 5;
        assert_eq!(cublasGetPointerMode_v2(h, &mut pm), 0);
        assert_eq!(pm, 0);
        assert_eq!(cublasSetWorkspace_v2(h, null_mut(), 0), 0);
        let name = CStr::from_ptr(cublasGetStatusName(7));
        assert_eq!(name.to_str().unwrap(), "CUBLAS_STATUS_INVALID_VALUE");
        assert!(!CStr::from_ptr(cublasGetStatusString(15)).is_empty());
        // Destroying the handle synchronises the device: pending work runs.
        let s = ctx.other;
        let d = [3f32, 4.0, 0.0].map(|v| upload(&[v], s));
        ok(cuStreamSynchronize(s));
        ok(call(h, &Raw::new(Api::Sgemm, [1, 1, 1]).scale(1.0, 1.0), d));
        let pinned = common::pinned(4) as *mut f32;
        *pinned = -1.0;
        ok(cuMemcpyDtoHAsync_v2(pinned as _, d[2], 4, s));
        assert_eq!(*pinned, -1.0, "not run yet");
        assert_eq!(cublasDestroy_v2(h), 0);
        assert_eq!(*pinned, 12.0);
        assert_eq!(cublasDestroy_v2(h), 1, "destroyed twice");
        assert_eq!(cublasSetMathMode(h, 0), 1);
        ok(cuMemFreeHost(pinned as _));
        for p in d {
            ok(cuMemFreeAsync(p, s));
        }
        ok(cuStreamSynchronize(s));
    }
}

#[test]
fn products_run_late_in_their_streams_order() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = setup();
    let h = handle(ctx.stream);
    let (s, o) = (ctx.stream, ctx.other);
    unsafe {
        let a = upload(&[1f32, 2.0, 3.0, 4.0], s); // [[1, 3], [2, 4]]
        let b = upload(&[10f32, 100.0], s);
        let c = upload(&[0f32, 0.0], s);
        ok(cuStreamSynchronize(s));
        ok(call(h, &Raw::new(Api::Sgemm, [2, 1, 2]), [a, b, c]));
        // A copy on the other stream, not ordered after the product, reads C as it was.
        assert_eq!(download::<f32>(c, 2, o), [0.0, 0.0]);
        // A copy on the same stream comes after it.
        let later = upload(&[7f32], s);
        ok(cuMemcpyDtoDAsync_v2(later, c, 4, s));
        // Ordered through an event, the other stream sees the product.
        let mut e = null_mut();
        ok(cuEventCreate(&mut e, 2));
        ok(cuEventRecord(e, s));
        ok(cuStreamWaitEvent(o, e, 0));
        assert_eq!(download::<f32>(c, 2, o), [310.0, 420.0]);
        assert_eq!(download::<f32>(later, 1, s), [310.0]);
        ok(cuEventDestroy_v2(e));
        for p in [a, b, c, later] {
            ok(cuMemFreeAsync(p, s));
        }
        ok(cuStreamSynchronize(s));
    }
    assert_eq!(cublasDestroy_v2(h), 0);
}

#[test]
fn an_operand_outside_its_allocation_is_a_fault() {
    faults_in_child(
        "an_operand_outside_its_allocation_is_a_fault",
        "operand A",
        || {
            let ctx = setup();
            let h = handle(ctx.stream);
            let s = ctx.stream;
            // A holds 64 x 4 floats (one 1 KiB allocation); lda = 65 reaches past its end.
            let d = [256, 16, 256].map(|n| upload(&vec![1f32; n], s));
            let r = Raw::new(Api::Sgemm, [64, 4, 4]).ld([65, 4, 64]);
            unsafe {
                assert_eq!(call(h, &r, d), 13);
                assert_eq!(cuStreamSynchronize(s), 700, "the fault poisons the driver");
                assert_eq!(call(h, &Raw::new(Api::Sgemm, [1, 1, 1]), d), 13);
            }
        },
    );
}

#[test]
fn an_operand_allocated_out_of_order_is_a_fault() {
    faults_in_child(
        "an_operand_allocated_out_of_order_is_a_fault",
        "without waiting for its allocation",
        || {
            let ctx = setup();
            let h = handle(ctx.stream);
            let a = upload(&[1f32; 4], ctx.stream);
            // C is allocated in the other stream's order, which the product does not wait for.
            let c = upload(&[1f32; 4], ctx.other);
            let r = Raw::new(Api::Sgemm, [2, 2, 2]);
            assert_eq!(unsafe { call(h, &r, [a, a, c]) }, 13);
        },
    );
}

/// The emulator built as a shared library by cargo, beside this test's executable.
fn cdylib() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libtidemem_cuda_emu.so"))
        .find(|p| p.exists())
        .expect("libtidemem_cuda_emu.so next to the test executable")
}

#[test]
fn libcuda_and_libcublas_are_one_library() {
    use libloading::os::unix::{Library, Symbol};
    let dir = std::env::temp_dir().join(format!("tidemem-emu-cublas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let so = cdylib();
    for name in ["libcuda.so", "libcublas.so.13"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&so, &link).unwrap();
    }
    unsafe {
        let cuda = Library::new(dir.join("libcuda.so")).unwrap();
        let blas = Library::new(dir.join("libcublas.so.13")).unwrap();
        let addr = |lib: &Library, name: &[u8]| *lib.get::<*mut c_void>(name).unwrap();
        let (x, y) = (addr(&cuda, b"cuInit"), addr(&blas, b"cuInit"));
        assert_eq!(x, y, "one library, loaded once");
        // Driver calls through one name, a product through the other: the product sees the
        // driver's allocations (an allocation it did not know would be a fault).
        let init: Symbol<unsafe extern "C" fn(u32) -> i32> = cuda.get(b"cuInit").unwrap();
        let retain: Symbol<unsafe extern "C" fn(*mut *mut c_void, i32) -> i32> =
            cuda.get(b"cuDevicePrimaryCtxRetain").unwrap();
        let set: Symbol<unsafe extern "C" fn(*mut c_void) -> i32> =
            cuda.get(b"cuCtxSetCurrent").unwrap();
        let alloc: Symbol<unsafe extern "C" fn(*mut u64, usize) -> i32> =
            cuda.get(b"cuMemAlloc_v2").unwrap();
        let htod: Symbol<unsafe extern "C" fn(u64, *const c_void, usize) -> i32> =
            cuda.get(b"cuMemcpyHtoD_v2").unwrap();
        let dtoh: Symbol<unsafe extern "C" fn(*mut c_void, u64, usize) -> i32> =
            cuda.get(b"cuMemcpyDtoH_v2").unwrap();
        let create: Symbol<unsafe extern "C" fn(*mut *mut c_void) -> i32> =
            blas.get(b"cublasCreate_v2").unwrap();
        type Sgemm = unsafe extern "C" fn(
            *mut c_void,
            i32,
            i32,
            i32,
            i32,
            i32,
            *const f32,
            *const f32,
            i32,
            *const f32,
            i32,
            *const f32,
            *mut f32,
            i32,
        ) -> i32;
        let sgemm: Symbol<Sgemm> = blas.get(b"cublasSgemm_v2").unwrap();
        let destroy: Symbol<unsafe extern "C" fn(*mut c_void) -> i32> =
            blas.get(b"cublasDestroy_v2").unwrap();
        ok(init(0));
        let mut ctx = null_mut();
        ok(retain(&mut ctx, 0));
        ok(set(ctx));
        let mut d = 0u64;
        ok(alloc(&mut d, 16));
        let v = [2f32, 3.0, 5.0, 0.0];
        ok(htod(d, v.as_ptr() as _, 16));
        let mut h = null_mut();
        assert_eq!(create(&mut h), 0);
        let (one, zero) = (1f32, 0f32);
        // C[3] = A[0] * B[1]: 2 * 3 on the null stream.
        let p = d as *mut f32;
        assert_eq!(
            sgemm(
                h,
                0,
                0,
                1,
                1,
                1,
                &one,
                p,
                1,
                p.add(1),
                1,
                &zero,
                p.add(3),
                1
            ),
            0
        );
        let mut out = [0f32; 4];
        ok(dtoh(out.as_mut_ptr() as _, d, 16));
        assert_eq!(out, [2.0, 3.0, 5.0, 6.0]);
        assert_eq!(destroy(h), 0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
