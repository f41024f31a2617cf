// The bindings' shared scenario, in Rust: a CPU engine, two sequences, a
// synthetic context appended in chunks, decoding steps for both sequences in
// one batch compared with exact attention computed here (f64), the stats,
// a sequence saved to a file and loaded back (decoding it bit for bit as the
// original, a corrupted copy and an engine of another head_dim refused), and
// three errors (a bad shape, an unknown layer, use after close) with their
// status and message.
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use wavekv::{Config, Dtype, Engine, PageFormat, Plan, Sequence, Status, Strides, F16};

const N_LAYERS: u32 = 2;
const N_Q: usize = 4;
const N_KV: usize = 2;
const D: usize = 64;
const TOPICS: usize = 8;
const CHUNK: usize = 700; // prompt chunks cut across segment boundaries
const STEPS: usize = 4;

// SplitMix64, with Box-Muller normals: the same numbers on every platform.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

// Keys of realistic structure: per KV head a shared offset, a few topics,
// and noise; values are noise. Queries lean towards one topic.
struct Model {
    offset: Vec<f64>, // [N_KV][D]
    topics: Vec<f64>, // [N_KV][TOPICS][D]
}

impl Model {
    fn new(rng: &mut Rng) -> Model {
        Model {
            offset: (0..N_KV * D).map(|_| 2.0 * rng.normal()).collect(),
            topics: (0..N_KV * TOPICS * D).map(|_| rng.normal()).collect(),
        }
    }

    // One token's k and v, [N_KV][D] each, appended to the vectors.
    fn token(&self, rng: &mut Rng, k: &mut Vec<f32>, v: &mut Vec<f32>) {
        for g in 0..N_KV {
            let z = rng.below(TOPICS);
            for i in 0..D {
                let x = self.offset[g * D + i]
                    + self.topics[(g * TOPICS + z) * D + i]
                    + 0.5 * rng.normal();
                k.push(x as f32);
                v.push(rng.normal() as f32);
            }
        }
    }

    // One sequence's queries, [N_Q][D].
    fn query(&self, rng: &mut Rng, q: &mut Vec<f32>) {
        let group = N_Q / N_KV;
        for h in 0..N_Q {
            let g = h / group;
            let z = rng.below(TOPICS);
            for i in 0..D {
                q.push((0.5 * self.topics[(g * TOPICS + z) * D + i] + 0.3 * rng.normal()) as f32);
            }
        }
    }
}

// Exact attention of one sequence's queries over all its tokens of a layer,
// in f64: out [N_Q][D] and the log-sum-exp of the scaled scores [N_Q].
fn exact_attention(q: &[f32], k: &[f32], v: &[f32], out: &mut Vec<f64>, lse: &mut Vec<f64>) {
    let n = k.len() / (N_KV * D);
    let scale = 1.0 / (D as f64).sqrt();
    let group = N_Q / N_KV;
    let mut scores = vec![0.0f64; n];
    for h in 0..N_Q {
        let g = h / group;
        let qh = &q[h * D..(h + 1) * D];
        let mut max = f64::NEG_INFINITY;
        for (t, s) in scores.iter_mut().enumerate() {
            let kt = &k[(t * N_KV + g) * D..(t * N_KV + g + 1) * D];
            *s = qh
                .iter()
                .zip(kt)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0;
        let mut acc = vec![0.0f64; D];
        for (t, s) in scores.iter().enumerate() {
            let w = (s - max).exp();
            sum += w;
            let vt = &v[(t * N_KV + g) * D..(t * N_KV + g + 1) * D];
            for i in 0..D {
                acc[i] += w * vt[i] as f64;
            }
        }
        out.extend(acc.iter().map(|a| a / sum));
        lse.push(max + sum.ln());
    }
}

fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

fn config(retrieval: f32, estimation: f32) -> Config {
    Config::new(N_LAYERS, N_Q as u32, N_KV as u32, D as u32)
        .dtype(Dtype::F32)
        .threads(1)
        .segment_tokens(512)
        .update_segment_tokens(128)
        .retrieval_frac(retrieval)
        .estimation_frac(estimation)
}

// The context of one sequence: K and V of every layer, [tokens][N_KV][D].
struct Context {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn context(model: &Model, rng: &mut Rng, tokens: usize) -> Context {
    let mut c = Context {
        k: Vec::new(),
        v: Vec::new(),
    };
    for _ in 0..N_LAYERS {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..tokens {
            model.token(rng, &mut k, &mut v);
        }
        c.k.push(k);
        c.v.push(v);
    }
    c
}

fn prefill(seq: &mut Sequence, c: &Context) {
    let row = N_KV * D;
    for layer in 0..N_LAYERS {
        let (k, v) = (&c.k[layer as usize], &c.v[layer as usize]);
        for start in (0..k.len()).step_by(CHUNK * row) {
            let end = (start + CHUNK * row).min(k.len());
            seq.append(layer, &k[start..end], &v[start..end]).unwrap();
        }
        seq.end_prompt(layer).unwrap();
        let info = seq.info(layer).unwrap();
        assert_eq!(info.tokens as usize, k.len() / row);
        assert!(info.clustered > 0 && info.clusters > 0, "{:?}", info);
    }
}

struct Outcome {
    max_err: f64,
    engine: Engine,
    seqs: Vec<Sequence>,
    plan: Plan,
}

// Prefills two sequences and decodes STEPS steps for both at every layer;
// returns the largest relative L2 error against exact attention.
fn run(retrieval: f32, estimation: f32, lengths: [usize; 2]) -> Outcome {
    let engine = Engine::open(&config(retrieval, estimation)).unwrap();
    assert_eq!(engine.dtype(), Dtype::F32);
    let mut rng = Rng(42);
    let model = Model::new(&mut rng);
    let mut contexts: Vec<Context> = lengths
        .iter()
        .map(|&n| context(&model, &mut rng, n))
        .collect();
    let mut seqs: Vec<Sequence> = (0..2).map(|_| engine.create_sequence().unwrap()).collect();
    for (seq, c) in seqs.iter_mut().zip(&contexts) {
        prefill(seq, c);
    }
    let mut plan = engine.create_plan().unwrap();
    let mut max_err: f64 = 0.0;
    for _ in 0..STEPS {
        for layer in 0..N_LAYERS as usize {
            let mut q = Vec::new();
            for (seq, c) in seqs.iter_mut().zip(contexts.iter_mut()) {
                let (mut k, mut v) = (Vec::new(), Vec::new());
                model.token(&mut rng, &mut k, &mut v);
                seq.append(layer as u32, &k, &v).unwrap();
                c.k[layer].extend(&k);
                c.v[layer].extend(&v);
                model.query(&mut rng, &mut q);
            }
            let mut out = vec![0.0f32; 2 * N_Q * D];
            plan.decode(&[&seqs[0], &seqs[1]], layer as u32, &q, &mut out)
                .unwrap();
            let (mut want, mut lse) = (Vec::new(), Vec::new());
            for (s, c) in contexts.iter().enumerate() {
                exact_attention(
                    &q[s * N_Q * D..(s + 1) * N_Q * D],
                    &c.k[layer],
                    &c.v[layer],
                    &mut want,
                    &mut lse,
                );
            }
            max_err = max_err.max(rel_l2(&out, &want));
        }
    }
    Outcome {
        max_err,
        engine,
        seqs,
        plan,
    }
}

#[test]
fn decoding_at_full_retrieval_is_exact_attention() {
    let o = run(1.0, 0.0, [3000, 2400]);
    println!(
        "full retrieval: largest relative L2 error {:.3e}",
        o.max_err
    );
    assert!(o.max_err < 1e-4, "relative L2 error {}", o.max_err);
}

#[test]
fn scenario_default_budget_stats_and_errors() {
    let defaults = Config::new(1, 1, 1, 64);
    let Outcome {
        max_err,
        mut engine,
        mut seqs,
        mut plan,
    } = run(
        defaults.retrieval_frac,
        defaults.estimation_frac,
        [3000, 2400],
    );
    println!("default budget: largest relative L2 error {:.3}", max_err);
    assert!(max_err < 0.5, "relative L2 error {}", max_err);

    // The stats.
    let stats = engine.stats().unwrap();
    assert_eq!(stats.sequences, 2);
    let held = (3000 + STEPS as u64 + 2400 + STEPS as u64) * N_LAYERS as u64;
    assert_eq!(stats.tokens, held);
    assert!(stats.clusters > 0 && stats.segments > 0, "{:?}", stats);
    assert_eq!(stats.lookups, (STEPS * N_LAYERS as usize * 2) as u64);
    assert!(stats.retrieved_clusters > 0 && stats.estimated_clusters > 0);
    let json = engine.stats_json().unwrap();
    assert!(
        json.starts_with('{') && json.contains("\"tokens\""),
        "{}",
        json
    );
    assert_eq!(seqs[0].info(0).unwrap().generating, 1);

    save_and_load(&engine, &seqs[0], &mut plan);

    // 1. A bad shape: caught by the binding (a slice that is not whole
    // tokens) and by the library (strides whose rows overlap).
    let k = vec![0.0f32; N_KV * D + 10];
    let e = seqs[0].append(0, &k, &k).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(
        e.message().contains("wkv_seq_append") && e.message().contains("multiple"),
        "{}",
        e
    );
    let q = vec![0.0f32; 2 * N_Q * D];
    let mut out = vec![0.0f32; 2 * N_Q * D];
    let overlapping = Strides::new((N_Q * D) as i64, (D / 2) as i64);
    let e = plan
        .decode_strided(
            &[&seqs[0], &seqs[1]],
            0,
            &q,
            overlapping,
            &mut out,
            Strides::PACKED,
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("stride"), "{}", e);
    let e = plan
        .decode(&[&seqs[0], &seqs[1]], 0, &q[..N_Q * D], &mut out)
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    let e = seqs[0]
        .append(0, &[F16(0); N_KV * D], &[F16(0); N_KV * D])
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(
        e.message().contains("f16") && e.message().contains("f32"),
        "{}",
        e
    );

    // 2. An unknown layer, from the library.
    let k = vec![0.0f32; N_KV * D];
    let e = seqs[0].append(N_LAYERS, &k, &k).unwrap_err();
    assert_eq!(e.status(), Status::OutOfRange);
    assert!(e.message().contains("layer"), "{}", e);
    let e = plan
        .decode(&[&seqs[0], &seqs[1]], 7, &q, &mut out)
        .unwrap_err();
    assert_eq!(e.status(), Status::OutOfRange);
    assert!(e.message().contains("layer"), "{}", e);
    // The message was copied: later calls do not change it.
    seqs[0].info(0).unwrap();
    assert!(e.message().contains("layer"));
    assert!(e.to_string().starts_with("WKV_ERR_OUT_OF_RANGE: "), "{}", e);

    // 3. Use after close: an error, never a dangling handle.
    seqs[1].close();
    seqs[1].close(); // again: a no-op
    assert!(seqs[1].is_closed());
    let e = seqs[1].append(0, &k, &k).unwrap_err();
    assert_eq!(e.status(), Status::InvalidHandle);
    assert!(e.message().contains("closed"), "{}", e);
    assert_eq!(seqs[1].info(0).unwrap_err().status(), Status::InvalidHandle);
    let e = plan
        .decode(&[&seqs[0], &seqs[1]], 0, &q, &mut out)
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidHandle);
    assert!(
        e.message().contains("sequence 1") && e.message().contains("closed"),
        "{}",
        e
    );
    engine.close();
    let e = engine.create_sequence().unwrap_err();
    assert_eq!(e.status(), Status::InvalidHandle);
    assert!(e.message().contains("engine is closed"), "{}", e);
    assert_eq!(engine.stats().unwrap_err().status(), Status::InvalidHandle);

    // Sequences and plans outlive the engine handle (wavekv.h).
    seqs[0].append(0, &k, &k).unwrap();
    plan.decode(&[&seqs[0]], 0, &q[..N_Q * D], &mut out[..N_Q * D])
        .unwrap();
    assert!(out[..N_Q * D].iter().all(|x| x.is_finite()));
    plan.close();
    let e = plan
        .decode(&[&seqs[0]], 0, &q[..N_Q * D], &mut out[..N_Q * D])
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidHandle);
    assert!(e.message().contains("plan is closed"), "{}", e);
}

// A directory of this test's own under cargo's temporary directory for
// integration tests, empty at the start.
fn temp_dir(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{}-{}", name, std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

// Saves `seq` (after its decoding steps), loads it into the same engine and
// decodes one query on both at every layer: the outputs must be the same
// bits, since a loaded sequence holds the saved one's index and pages
// unchanged. Then a copy with one byte changed in its middle must be refused
// as corrupt, and the intact file by an engine of another head_dim.
fn save_and_load(engine: &Engine, seq: &Sequence, plan: &mut Plan) {
    let dir = temp_dir("wavekv-scenario");
    let path = dir.join("seq.wkv");
    seq.save(&path, false).unwrap();
    let sequences = engine.stats().unwrap().sequences;
    let mut loaded = engine.load(&path).unwrap();
    assert_eq!(engine.stats().unwrap().sequences, sequences + 1);
    let mut rng = Rng(5);
    for layer in 0..N_LAYERS {
        assert_eq!(loaded.info(layer).unwrap(), seq.info(layer).unwrap());
        let q: Vec<f32> = (0..N_Q * D).map(|_| rng.normal() as f32).collect();
        let mut a = vec![0.0f32; N_Q * D];
        let mut b = vec![1.0f32; N_Q * D];
        plan.decode(&[seq], layer, &q, &mut a).unwrap();
        plan.decode(&[&loaded], layer, &q, &mut b).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert!(
            bits(&a) == bits(&b),
            "layer {}: the loaded sequence decodes differently",
            layer
        );
    }
    loaded.close();

    // One byte changed in the middle of the file: refused, and nothing of it
    // is left in the engine. Counted again here: the plan still refers to
    // the closed loaded sequence until its next lookup, which keeps it alive
    // (wavekv.h).
    let sequences = engine.stats().unwrap().sequences;
    let mut bytes = fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5a;
    let corrupt = dir.join("corrupt.wkv");
    fs::write(&corrupt, &bytes).unwrap();
    let e = engine.load(&corrupt).unwrap_err();
    assert_eq!(e.status(), Status::Corrupt, "{}", e);
    assert!(e.message().contains("section"), "{}", e);
    assert!(e.to_string().starts_with("WKV_ERR_CORRUPT: "), "{}", e);
    assert_eq!(engine.stats().unwrap().sequences, sequences);

    // An engine of another shape: the message names the difference.
    let other = Engine::open(
        &Config::new(N_LAYERS, N_Q as u32, N_KV as u32, 2 * D as u32)
            .dtype(Dtype::F32)
            .threads(1)
            .segment_tokens(512)
            .update_segment_tokens(128),
    )
    .unwrap();
    let e = other.load(&path).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
    assert!(e.message().contains("head_dim"), "{}", e);

    // Refused by the binding (a NUL would cut the path short in C) and by
    // the library (no such file).
    let e = engine.load("seq\0.wkv").unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("NUL"), "{}", e);
    let e = engine.load(dir.join("missing.wkv")).unwrap_err();
    assert_eq!(e.status(), Status::Io, "{}", e);
    fs::remove_dir_all(&dir).unwrap();
}

// Attending with your own kernel: lookup, assemble, attention over the
// execution buffer computed here, merge, update; the result matches
// wkv_decode, and so does wkv_attend.
#[test]
fn own_attention_over_the_execution_buffer_merges_to_decode() {
    let engine = Engine::open(&config(0.05, 0.3)).unwrap();
    let mut rng = Rng(7);
    let model = Model::new(&mut rng);
    let mut seqs = Vec::new();
    for n in [1500, 1100] {
        let mut seq = engine.create_sequence().unwrap();
        prefill(&mut seq, &context(&model, &mut rng, n));
        seqs.push(seq);
    }
    let mut q = Vec::new();
    model.query(&mut rng, &mut q);
    model.query(&mut rng, &mut q);
    let batch = [&seqs[0], &seqs[1]];
    let layer = 1;

    let mut mine = vec![0.0f32; 2 * N_Q * D];
    let mut lse = vec![0.0f32; 2 * N_Q];
    let mut plan = engine.create_plan().unwrap();
    {
        // Attend needs an assemble first; the failed step may be gone.
        let mut step = plan.lookup(&batch, layer, &q).unwrap();
        let e = step.attend(&mut mine, None).unwrap_err();
        assert_eq!(e.status(), Status::State, "{}", e);
    }
    {
        let mut step = plan.lookup(&batch, layer, &q).unwrap();
        assert_eq!(step.n_seqs(), 2);
        step.assemble().unwrap();
        let x = step.xbuf::<f32>().unwrap();
        assert_eq!(x.n_runs as usize, 2 * N_KV);
        assert_eq!(x.offsets[0], 0);
        let group = N_Q / N_KV;
        for s in 0..2 {
            for h in 0..N_Q {
                let (k, v) = x.run(s * N_KV + h / group).unwrap();
                assert!(!k.is_empty());
                // Reuse exact_attention with one KV head: the run's tokens.
                let mut kk = Vec::new();
                let mut vv = Vec::new();
                for t in 0..k.len() / D {
                    for _ in 0..N_KV {
                        kk.extend_from_slice(&k[t * D..(t + 1) * D]);
                        vv.extend_from_slice(&v[t * D..(t + 1) * D]);
                    }
                }
                let qh = &q[(s * N_Q + h) * D..(s * N_Q + h + 1) * D];
                let mut qq = vec![0.0f32; N_Q * D];
                qq[..D].copy_from_slice(qh);
                let (mut o, mut l) = (Vec::new(), Vec::new());
                exact_attention(&qq, &kk, &vv, &mut o, &mut l);
                for i in 0..D {
                    mine[(s * N_Q + h) * D + i] = o[i] as f32;
                }
                lse[s * N_Q + h] = l[0] as f32;
            }
        }
        assert!(x.run(2 * N_KV).is_none());
        step.merge(&mut mine, &mut lse).unwrap();
        step.update().unwrap();
    }

    let mut decoded = vec![0.0f32; 2 * N_Q * D];
    engine
        .create_plan()
        .unwrap()
        .decode(&batch, layer, &q, &mut decoded)
        .unwrap();
    let want: Vec<f64> = decoded.iter().map(|x| *x as f64).collect();
    let err = rel_l2(&mine, &want);
    assert!(err < 1e-5, "merged own attention vs decode: {}", err);

    let mut attended = vec![0.0f32; 2 * N_Q * D];
    let mut lse2 = vec![0.0f32; 2 * N_Q];
    let mut step = plan.lookup(&batch, layer, &q).unwrap();
    step.assemble().unwrap();
    step.attend(&mut attended, Some(&mut lse2)).unwrap();
    step.update().unwrap();
    assert!(rel_l2(&attended, &want) < 1e-5);
    for (a, b) in lse.iter().zip(&lse2) {
        assert!((a - b).abs() < 1e-3, "lse {} vs {}", a, b);
    }
}

#[test]
fn status_names_match_the_library() {
    for code in 1..=13 {
        let status = Status::from_code(code).unwrap();
        assert_eq!(status.code(), code);
        let c = unsafe { std::ffi::CStr::from_ptr(wavekv::sys::wkv_status_name(code)) };
        assert_eq!(status.name(), c.to_str().unwrap());
    }
    assert_eq!(Status::from_code(0), None);
    assert_eq!(Status::from_code(99), Some(Status::Unknown(99)));
    assert_eq!(wavekv::version_string(), {
        let (a, b, c) = wavekv::version();
        format!("{}.{}.{}", a, b, c)
    });
}

#[test]
fn an_engine_serves_threads_that_each_own_a_sequence_and_a_plan() {
    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}
    assert_send_sync::<Engine>();
    assert_send::<Sequence>();
    assert_send::<Plan>();

    // Full retrieval, so that each result must equal exact attention.
    let engine = Engine::open(&config(1.0, 0.0)).unwrap();
    let results: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2u64)
            .map(|t| {
                let engine = &engine;
                scope.spawn(move || {
                    let mut rng = Rng(100 + t);
                    let model = Model::new(&mut rng);
                    let c = context(&model, &mut rng, 900);
                    let mut seq = engine.create_sequence().unwrap();
                    prefill(&mut seq, &c);
                    let mut plan = engine.create_plan().unwrap();
                    let mut q = Vec::new();
                    model.query(&mut rng, &mut q);
                    let mut out = vec![0.0f32; N_Q * D];
                    plan.decode(&[&seq], 0, &q, &mut out).unwrap();
                    let (mut want, mut lse) = (Vec::new(), Vec::new());
                    exact_attention(&q, &c.k[0], &c.v[0], &mut want, &mut lse);
                    rel_l2(&out, &want)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for err in results {
        assert!(err < 1e-4, "relative L2 error {}", err);
    }
    assert_eq!(engine.stats().unwrap().sequences, 0);
}

#[test]
fn config_reads_back_and_bad_configs_are_refused() {
    let engine = Engine::open(&config(0.1, 0.2)).unwrap();
    let c = engine.config().unwrap();
    assert_eq!(
        (c.n_layers, c.n_q_heads, c.n_kv_heads, c.head_dim),
        (2, 4, 2, 64)
    );
    assert_eq!(c.segment_tokens, 512);
    assert_eq!(c.dtype, Dtype::F32.raw());
    assert!((c.retrieval_frac - 0.1).abs() < 1e-6);
    assert_eq!(engine.device(), wavekv::Device::Cpu);

    let e = Engine::open(&Config::new(2, 4, 3, 64)).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(!e.message().is_empty());
    let e = Engine::open(&Config::new(2, 4, 2, 63)).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{}", e);
}

// Pages of 8-bit rows (0.10): the engine's configuration says so, and with
// every cluster retrieved a decode is attention over the 8-bit rows of the
// clustered segments, close to exact attention over the rows as appended.
// A format the header does not list is refused.
#[test]
fn an_engine_of_int8_pages_decodes_close_to_exact_attention() {
    assert_eq!(
        Config::new(2, 4, 2, 64).page_format,
        PageFormat::Storage.raw()
    );
    // Centered keys (0.11) likewise, keys less their clusters' centroids.
    for format in [PageFormat::Int8, PageFormat::Int8Centered] {
        let engine = Engine::open(&config(1.0, 0.0).page_format(format)).unwrap();
        let c = engine.config().unwrap();
        assert_eq!(PageFormat::from_raw(c.page_format), Some(format));
        assert_eq!(c.dtype, Dtype::F32.raw());
        let mut rng = Rng(21);
        let model = Model::new(&mut rng);
        let ctx = context(&model, &mut rng, 1200);
        let mut seq = engine.create_sequence().unwrap();
        prefill(&mut seq, &ctx);
        let mut plan = engine.create_plan().unwrap();
        let mut q = Vec::new();
        model.query(&mut rng, &mut q);
        let mut out = vec![0.0f32; N_Q * D];
        plan.decode(&[&seq], 0, &q, &mut out).unwrap();
        let (mut want, mut lse) = (Vec::new(), Vec::new());
        exact_attention(&q, &ctx.k[0], &ctx.v[0], &mut want, &mut lse);
        let err = rel_l2(&out, &want);
        assert!(err < 0.05, "{:?}: relative L2 error {}", format, err);
    }

    let mut bad = config(1.0, 0.0);
    bad.as_raw_mut().page_format = 3;
    let e = Engine::open(&bad).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
    assert!(e.message().contains("page_format"), "{}", e.message());
}

// The spill tier: an evicted sequence's next decode reads its pages back and
// gives the same bits; an engine without a spill directory refuses.
#[test]
fn an_evicted_sequence_decodes_the_same_after_its_restore() {
    let dir = temp_dir("wavekv-spill");
    let cfg = config(0.018, 0.232).spill_budget_bytes(1 << 30);
    let engine = Engine::open_with_files(&cfg, Some(&dir), None).unwrap();
    let mut bad = dir.as_os_str().as_bytes().to_vec();
    bad.extend_from_slice(b"\0x");
    let bad = PathBuf::from(std::ffi::OsStr::from_bytes(&bad));
    let e = Engine::open_with_files(&cfg, Some(&bad), None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
    let mut rng = Rng(9);
    let model = Model::new(&mut rng);
    let c = context(&model, &mut rng, 3000);
    let mut seq = engine.create_sequence().unwrap();
    prefill(&mut seq, &c);
    let mut plan = engine.create_plan().unwrap();
    let q: Vec<f32> = (0..N_Q * D).map(|_| rng.normal() as f32).collect();
    let mut decode_all = |seq: &Sequence| -> Vec<u32> {
        let mut all = Vec::new();
        for layer in 0..N_LAYERS {
            let mut out = vec![0.0f32; N_Q * D];
            plan.decode(&[seq], layer, &q, &mut out).unwrap();
            all.extend(out.iter().map(|v| v.to_bits()));
        }
        all
    };
    // Every layer's info: evicted with every page in the spill file, or in
    // memory with none there.
    fn spilled(seq: &Sequence, evicted: bool) {
        for layer in 0..N_LAYERS {
            let info = seq.info(layer).unwrap();
            assert!(info.pages > 0, "layer {}: {:?}", layer, info);
            assert_eq!(info.evicted, evicted as u32, "layer {}: {:?}", layer, info);
            let want = if evicted { info.pages } else { 0 };
            assert_eq!(info.spilled_pages, want, "layer {}: {:?}", layer, info);
        }
    }
    let before = decode_all(&seq);
    spilled(&seq, false);
    seq.evict().unwrap();
    spilled(&seq, true);
    let st = engine.stats().unwrap();
    assert_eq!(st.evicted_sequences, 1);
    assert!(st.spill_bytes_used > 0 && st.spill_io != 0);
    assert!(
        decode_all(&seq) == before,
        "the restored sequence decodes differently"
    );
    seq.evict().unwrap();
    seq.restore().unwrap();
    spilled(&seq, false);
    assert_eq!(engine.stats().unwrap().spill_bytes_used, 0);

    let plain = Engine::open(&config(0.018, 0.232)).unwrap();
    let mut other = plain.create_sequence().unwrap();
    let err = other.evict().unwrap_err();
    assert_eq!(err.status(), Status::State);
    assert!(err.message().contains("spill_dir"), "{}", err.message());
}

// wkv_append_batch (0.5): each step's new tokens appended to three
// sequences in one call decode bit for bit as the same tokens appended to
// each with wkv_seq_append: one token a step, three every 50th (speculative
// decoding), through the packed form (layer 0) and, on layer 1, the strided
// form over a layout interleaved by token with padded heads, over enough
// generated tokens that segments complete and are clustered (index growths)
// under both.
#[test]
fn a_batch_append_decodes_as_one_append_per_sequence() {
    const N: usize = 3;
    const STEPS_B: usize = 280; // 320 tokens: past update_segment_tokens (128) twice
    const HS: usize = D + 8; // padded heads, the padding NaN: never read
    let row = N_KV * D;
    let cfg = config(0.018, 0.232);
    let batch_engine = Engine::open(&cfg).unwrap();
    let single_engine = Engine::open(&cfg).unwrap();
    let mut rng = Rng(7);
    let model = Model::new(&mut rng);
    let contexts: Vec<Context> = [1500, 900, 2100]
        .iter()
        .map(|&n| context(&model, &mut rng, n))
        .collect();
    let mut batch: Vec<Sequence> = (0..N)
        .map(|_| batch_engine.create_sequence().unwrap())
        .collect();
    let mut single: Vec<Sequence> = (0..N)
        .map(|_| single_engine.create_sequence().unwrap())
        .collect();
    for i in 0..N {
        prefill(&mut batch[i], &contexts[i]);
        prefill(&mut single[i], &contexts[i]);
    }
    let prompt_clustered: Vec<u64> = single
        .iter()
        .map(|s| s.info(0).unwrap().clustered)
        .collect();
    let (mut batch_plan, mut single_plan) = (
        batch_engine.create_plan().unwrap(),
        single_engine.create_plan().unwrap(),
    );
    let (mut compared, mut generated) = (0, 0);
    for step in 0..STEPS_B {
        let n_tok = if step % 50 == 49 { 3 } else { 1 };
        generated += n_tok;
        for layer in 0..N_LAYERS {
            // Packed [N][n_tok][N_KV][D].
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for _ in 0..N * n_tok {
                model.token(&mut rng, &mut k, &mut v);
            }
            {
                let mut refs: Vec<&mut Sequence> = batch.iter_mut().collect();
                if layer == 0 {
                    Sequence::append_batch(&mut refs, layer, &k, &v).unwrap();
                } else {
                    // [n_tok][N][N_KV][HS]: sequence i at i * N_KV * HS.
                    let mut kp = vec![f32::NAN; n_tok * N * N_KV * HS];
                    let mut vp = kp.clone();
                    for i in 0..N {
                        for t in 0..n_tok {
                            for h in 0..N_KV {
                                let from = ((i * n_tok + t) * N_KV + h) * D;
                                let to = ((t * N + i) * N_KV + h) * HS;
                                kp[to..to + D].copy_from_slice(&k[from..from + D]);
                                vp[to..to + D].copy_from_slice(&v[from..from + D]);
                            }
                        }
                    }
                    Sequence::append_batch_strided(
                        &mut refs,
                        layer,
                        &kp,
                        &vp,
                        n_tok as u32,
                        (N_KV * HS) as i64,
                        Strides::new((N * N_KV * HS) as i64, HS as i64),
                    )
                    .unwrap();
                }
            }
            let per = n_tok * row;
            for (i, s) in single.iter_mut().enumerate() {
                s.append(
                    layer,
                    &k[i * per..(i + 1) * per],
                    &v[i * per..(i + 1) * per],
                )
                .unwrap();
            }
            if step % 25 == 24 || step + 1 == STEPS_B {
                let mut q = Vec::new();
                for _ in 0..N {
                    model.query(&mut rng, &mut q);
                }
                let mut got = vec![0.0f32; N * N_Q * D];
                let mut want = vec![0.0f32; N * N_Q * D];
                batch_plan
                    .decode(&[&batch[0], &batch[1], &batch[2]], layer, &q, &mut got)
                    .unwrap();
                single_plan
                    .decode(&[&single[0], &single[1], &single[2]], layer, &q, &mut want)
                    .unwrap();
                let differ = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(
                    differ.is_none(),
                    "step {}, layer {}: element {:?} differs",
                    step,
                    layer,
                    differ
                );
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 2 * (STEPS_B / 25 + 1));
    for i in 0..N {
        for layer in 0..N_LAYERS {
            let (b, s) = (
                batch[i].info(layer).unwrap(),
                single[i].info(layer).unwrap(),
            );
            assert_eq!(b, s, "sequence {}, layer {}", i, layer);
            assert_eq!(b.tokens as usize, contexts[i].k[0].len() / row + generated);
        }
        let grown = batch[i].info(0).unwrap().clustered;
        assert!(
            grown > prompt_clustered[i],
            "sequence {}: no segment completed while generating ({} clustered tokens)",
            i,
            grown
        );
    }
    let (b, s) = (
        batch_engine.stats().unwrap(),
        single_engine.stats().unwrap(),
    );
    assert_eq!(
        (b.tokens, b.segments, b.clusters),
        (s.tokens, s.segments, s.clusters)
    );
}

// What a batch append refuses, before the library (the binding's checks) and
// in it, with its status and message; a refused batch appends nothing.
#[test]
fn a_batch_append_refuses_bad_batches_and_appends_nothing() {
    let row = N_KV * D;
    let engine = Engine::open(&config(1.0, 0.0)).unwrap();
    let other = Engine::open(&config(1.0, 0.0)).unwrap();
    let (mut a, mut b, mut c) = (
        engine.create_sequence().unwrap(),
        engine.create_sequence().unwrap(),
        engine.create_sequence().unwrap(),
    );
    let mut x = other.create_sequence().unwrap();
    let kv = vec![0.5f32; 2 * row];
    let expect = |r: wavekv::Result<()>, status: Status, words: &[&str]| {
        let e = r.unwrap_err();
        assert_eq!(e.status(), status, "{}", e);
        assert!(e.message().starts_with("wkv_append_batch: "), "{}", e);
        for w in words {
            assert!(e.message().contains(w), "{:?} lacks {:?}", e.message(), w);
        }
    };

    // The binding's checks: lengths, dtype, an empty batch, short slices.
    let short = &kv[..2 * row - 8];
    expect(
        Sequence::append_batch(&mut [&mut a, &mut b], 0, short, short),
        Status::InvalidArgument,
        &["multiple", "n_seqs x n_kv_heads x head_dim"],
    );
    expect(
        Sequence::append_batch(&mut [&mut a, &mut b], 0, &kv, &kv[..row]),
        Status::InvalidArgument,
        &["v has"],
    );
    let half = vec![F16::from_f32(0.5); 2 * row];
    expect(
        Sequence::append_batch(&mut [&mut a, &mut b], 0, &half, &half),
        Status::InvalidArgument,
        &["f16"],
    );
    expect(
        Sequence::append_batch::<f32>(&mut [], 0, &kv, &kv),
        Status::InvalidArgument,
        &["n_seqs is 0"],
    );
    expect(
        Sequence::append_batch_strided(
            &mut [&mut a, &mut b],
            0,
            &kv,
            &kv,
            1,
            (row + 1) as i64,
            Strides::PACKED,
        ),
        Status::InvalidArgument,
        &["fewer than"],
    );
    expect(
        Sequence::append_batch_strided(&mut [&mut a, &mut b], 0, &kv, &kv, 1, -1, Strides::PACKED),
        Status::InvalidArgument,
        &["must not be negative"],
    );

    // The library's: sequences of two engines, a layer.
    expect(
        Sequence::append_batch(&mut [&mut a, &mut x], 0, &kv, &kv),
        Status::InvalidHandle,
        &["sequence 1 belongs to another engine"],
    );
    expect(
        Sequence::append_batch(&mut [&mut a, &mut b], N_LAYERS, &kv, &kv),
        Status::OutOfRange,
        &[],
    );
    // A sequence listed twice cannot be written in safe Rust (two &mut); the
    // library refuses it from raw handles.
    let twice = [a.as_raw(), a.as_raw()];
    let rc = unsafe {
        wavekv::sys::wkv_append_batch(
            twice.as_ptr(),
            2,
            0,
            kv.as_ptr() as *const std::os::raw::c_void,
            kv.as_ptr() as *const std::os::raw::c_void,
            1,
            0,
            0,
            0,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, Status::InvalidArgument.code());

    // A closed sequence.
    c.close();
    expect(
        Sequence::append_batch(&mut [&mut a, &mut c], 0, &kv, &kv),
        Status::InvalidHandle,
        &["sequence 1 of the batch is closed"],
    );

    for s in [&a, &b, &x] {
        assert_eq!(s.info(0).unwrap().tokens, 0, "a refused batch appended");
    }
    // And a good batch: one token each.
    Sequence::append_batch(&mut [&mut a, &mut b], 0, &kv, &kv).unwrap();
    assert_eq!(
        (a.info(0).unwrap().tokens, b.info(0).unwrap().tokens),
        (1, 1)
    );
    assert_eq!(engine.stats().unwrap().tokens, 2);
}

// Steps a runtime captures (wkv_plan_bind, 0.9) need a CUDA engine: a CPU
// engine refuses the binding, leaving the plan unbound (prepare and unbind
// then fail with State) and usable; a closed plan, or a closed sequence in
// the batch, is refused before calling in.
#[test]
fn a_cpu_engine_refuses_to_bind_a_plan() {
    let engine = Engine::open(&config(1.0, 0.0)).unwrap();
    let row = N_KV * D;
    let kv = vec![0.5f32; 4 * row];
    let (mut a, mut b) = (
        engine.create_sequence().unwrap(),
        engine.create_sequence().unwrap(),
    );
    for layer in 0..N_LAYERS {
        a.append(layer, &kv, &kv).unwrap();
        b.append(layer, &kv, &kv).unwrap();
    }
    let mut plan = engine.create_plan().unwrap();

    let e = plan.bind(&[&a, &b], 16).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{}", e);
    assert!(e.message().starts_with("wkv_plan_bind: "), "{}", e);
    let e = unsafe { plan.bind_raw(&[&a], 0, std::ptr::null_mut()) }.unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{}", e);
    for e in [plan.prepare().unwrap_err(), plan.unbind().unwrap_err()] {
        assert_eq!(e.status(), Status::State, "{}", e);
        assert!(e.message().contains("not bound"), "{}", e);
    }
    let e = unsafe { plan.prepare_raw(std::ptr::null_mut()) }.unwrap_err();
    assert_eq!(e.status(), Status::State, "{}", e);
    assert!(e.message().starts_with("wkv_plan_prepare: "), "{}", e);
    let e = unsafe { plan.unbind_raw(std::ptr::null_mut()) }.unwrap_err();
    assert_eq!(e.status(), Status::State, "{}", e);
    assert!(e.message().starts_with("wkv_plan_unbind: "), "{}", e);

    // Not bound: the plan and the sequences work as before.
    a.append(0, &kv[..row], &kv[..row]).unwrap();
    let q = vec![0.1f32; 2 * N_Q * D];
    let mut out = vec![0.0f32; 2 * N_Q * D];
    plan.decode(&[&a, &b], 0, &q, &mut out).unwrap();
    assert!(out.iter().all(|x| x.is_finite()));

    b.close();
    let e = plan.bind(&[&a, &b], 0).unwrap_err();
    assert_eq!(e.status(), Status::InvalidHandle, "{}", e);
    assert!(
        e.message().contains("sequence 1 of the batch is closed"),
        "{}",
        e
    );
    plan.close();
    let e = plan.bind(&[&a], 0).unwrap_err();
    assert_eq!(e.status(), Status::InvalidHandle, "{}", e);
    assert!(e.message().contains("plan is closed"), "{}", e);
    for e in [plan.prepare().unwrap_err(), plan.unbind().unwrap_err()] {
        assert_eq!(e.status(), Status::InvalidHandle, "{}", e);
        assert!(e.message().contains("plan is closed"), "{}", e);
    }
}
