//! The collectives of one transformer layer (two LayerNorms and four linears, `C → 3C`,
//! `C → C`, `C → 4C`, `4C → C`; attention is local in every scheme) under each
//! tensor-parallel scheme, from the layers' own formulas (the ones the tests check against the
//! communicators' counters), at GPT-2 sizes.
//!
//! ```sh
//! cargo run --release --example tp_costs
//! cargo run --release --example tp_costs -- --tokens 8192 --json
//! ```
//!
//! Per rank and per layer, forward and backward together: the collective calls and the bytes of
//! their buffers as the counters tally them (an all-reduce's buffer, an all-gather's output, a
//! reduce-scatter's input, a broadcast's buffer), in f16. 1D's block sends four all-reduces
//! of `tokens × C` (its LayerNorms are replicated); the 2D, 2.5D and 3D LayerNorms gather
//! whole rows of their tiles.

use clap::Parser;
use serde_json::json;
use tidemem::comm::CommStats;
use tidemem::parallel::{
    LayerNorm2D, LayerNorm3D, Layout3D, Linear2D, Linear2p5D, Linear3D, Place2D, Place3D,
};
use tidemem::tensor::TensorId;
use tidemem::DType;

#[derive(Parser, Debug)]
#[command(about = "Cost per transformer layer of each tensor-parallel scheme")]
struct Args {
    /// Tokens per step (batch × sequence).
    #[arg(long, default_value_t = 8192)]
    tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// A scheme: its name, ranks, and its calls and bytes for a layer of width `C`.
type Scheme<'a> = (
    &'static str,
    usize,
    Box<dyn Fn(usize) -> tidemem::Result<(u64, u64)> + 'a>,
);

/// Calls and bytes of a set of counters.
fn total(s: &CommStats) -> (u64, u64) {
    let t = [
        s.all_gather,
        s.reduce_scatter,
        s.all_reduce,
        s.broadcast,
        s.reduce,
        s.send,
        s.recv,
    ];
    t.iter()
        .fold((0, 0), |(c, b), x| (c + x.calls, b + x.bytes))
}

/// The four linears of a layer of width `c`: (inputs, outputs).
fn linears(c: usize) -> [(usize, usize); 4] {
    [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
}

fn add(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    (a.0 + b.0, a.1 + b.1)
}

fn summa(c: usize, tokens: usize, q: usize, depth: usize) -> tidemem::Result<(u64, u64)> {
    let ln = LayerNorm2D {
        gamma: TensorId(0),
        beta: TensorId(1),
        cols: c,
        eps: 1e-5,
        place: Place2D {
            q,
            depth,
            row: 0,
            col: 0,
            dep: 0,
        },
    };
    let s = ln.collectives(tokens, DType::F16)?;
    let mut sum = (0, 0);
    for g in [&s.forward, &s.backward] {
        for st in [&g.row, &g.col, &g.dep] {
            sum = add(sum, total(st));
        }
    }
    // two LayerNorms
    sum = add(sum, sum);
    for (i, o) in linears(c) {
        let slice = Linear2D {
            weight: TensorId(0),
            bias: Some(TensorId(1)),
            inputs: i,
            outputs: o,
            q,
            row: 0,
            col: 0,
        };
        let s = if depth == 1 {
            slice.collectives(tokens, DType::F16, true)?
        } else {
            let l = Linear2p5D {
                slice,
                depth,
                dep: 0,
            };
            l.collectives(tokens, DType::F16, true)?
        };
        for g in [&s.forward, &s.backward] {
            for st in [&g.row, &g.col, &g.dep] {
                sum = add(sum, total(st));
            }
        }
    }
    Ok(sum)
}

fn cube(c: usize, tokens: usize, q: usize) -> (u64, u64) {
    let place = Place3D {
        q,
        i: 0,
        j: 0,
        k: 0,
    };
    let ln = LayerNorm3D {
        gamma: TensorId(0),
        beta: TensorId(1),
        cols: c,
        eps: 1e-5,
        layout: Layout3D::RowsJColsK,
        place,
    };
    let s = ln.collectives(tokens / (q * q), DType::F16);
    let mut sum = (0, 0);
    for g in [&s.forward, &s.backward] {
        for st in [&g.input, &g.weight, &g.output] {
            sum = add(sum, total(st));
        }
    }
    // two LayerNorms
    sum = add(sum, sum);
    let mut layout = Layout3D::RowsJColsK;
    for (i, o) in linears(c) {
        let l = Linear3D {
            weight: TensorId(0),
            bias: Some(TensorId(1)),
            inputs: i,
            outputs: o,
            layout,
            place,
        };
        let s = l.collectives(tokens / (q * q), DType::F16, true);
        for g in [&s.forward, &s.backward] {
            for st in [&g.input, &g.weight, &g.output] {
                sum = add(sum, total(st));
            }
        }
        layout = layout.swapped();
    }
    sum
}

fn main() -> tidemem::Result<()> {
    let a = Args::parse();
    let models = [("gpt2 (124M)", 768usize), ("gpt2-xl (1.5B)", 1600)];
    let schemes: [Scheme; 7] = [
        (
            "1d:8",
            8,
            Box::new(|c| Ok((4, (4 * a.tokens * c * 2) as u64))),
        ),
        ("2.5d:2x2x2", 8, Box::new(|c| summa(c, a.tokens, 2, 2))),
        ("3d:2", 8, Box::new(|c| Ok(cube(c, a.tokens, 2)))),
        (
            "1d:64",
            64,
            Box::new(|c| Ok((4, (4 * a.tokens * c * 2) as u64))),
        ),
        ("2d:8", 64, Box::new(|c| summa(c, a.tokens, 8, 1))),
        ("2.5d:4x4x4", 64, Box::new(|c| summa(c, a.tokens, 4, 4))),
        ("3d:4", 64, Box::new(|c| Ok(cube(c, a.tokens, 4)))),
    ];
    let mut rows = Vec::new();
    for (model, c) in models {
        for (name, ranks, f) in &schemes {
            let (calls, bytes) = f(c)?;
            rows.push(json!({"model": model, "scheme": name, "ranks": ranks,
                             "calls": calls, "bytes": bytes}));
        }
    }
    if a.json {
        println!("{}", json!({ "tokens": a.tokens, "rows": rows }));
        return Ok(());
    }
    println!(
        "{} tokens a step, f16; per rank, one layer, forward + backward",
        a.tokens
    );
    println!(
        "{:<16} {:<12} {:>6} {:>8} {:>12}",
        "model", "scheme", "ranks", "calls", "MiB"
    );
    for r in &rows {
        println!(
            "{:<16} {:<12} {:>6} {:>8} {:>12.1}",
            r["model"].as_str().unwrap_or(""),
            r["scheme"].as_str().unwrap_or(""),
            r["ranks"].as_u64().unwrap_or(0),
            r["calls"].as_u64().unwrap_or(0),
            r["bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64
        );
    }
    Ok(())
}
