// Checks the hand-written declarations of src/lib.rs against wavekv.h, with
// the C compiler as the judge:
//
// 1. every WKV_API function of the header is declared in Rust and the other
//    way round, and every WKV_* constant likewise;
// 2. each Rust prototype, translated to C, is compiled after the header:
//    a conflicting type is an error;
// 3. each struct field's type is checked the same way (a pointer to the
//    field assigned to a pointer of the Rust field's C type, with -Werror);
// 4. a C program prints sizeof and offsetof of every struct and field and
//    the value of every constant, which must equal Rust's.
//
// $CC (default cc) is the compiler; the header is found relative to this
// crate (bindings/rust/wavekv-sys -> include/), or in $WAVEKV_INCLUDE_DIR.
use std::collections::BTreeMap;
use std::env;
use std::fs;
use std::mem;
use std::path::PathBuf;
use std::process::Command;

use wavekv_sys::*;

const RUST_SOURCE: &str = include_str!("../src/lib.rs");

fn include_dir() -> PathBuf {
    match env::var_os("WAVEKV_INCLUDE_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../include"),
    }
}

fn header_text() -> String {
    let path = include_dir().join("wavekv/wavekv.h");
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {}", path.display(), e))
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

// The text with comments removed and whitespace runs made one space.
fn squeeze(text: &str, line_comment: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while !rest.is_empty() {
        if rest.starts_with("/*") {
            rest = rest.find("*/").map_or("", |i| &rest[i + 2..]);
            out.push(' ');
        } else if rest.starts_with(line_comment) {
            rest = rest.find('\n').map_or("", |i| &rest[i..]);
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

// A Rust FFI type, as written in src/lib.rs, in C.
fn c_type(rust: &str) -> String {
    let t = rust.trim();
    if let Some(inner) = t.strip_prefix("*mut ") {
        return format!("{} *", c_type(inner));
    }
    if let Some(inner) = t.strip_prefix("*const ") {
        return format!("{} const *", c_type(inner));
    }
    match t {
        "u32" => "uint32_t",
        "i32" => "int32_t",
        "u64" => "uint64_t",
        "i64" => "int64_t",
        "f32" => "float",
        "c_void" => "void",
        "c_char" => "char",
        other if other.starts_with("wkv_") => other,
        other => panic!("no C type for the Rust type {:?}", other),
    }
    .to_string()
}

struct RustFn {
    name: String,
    params: Vec<(String, String)>,
    ret: Option<String>,
}

// `pub fn name(a: T, ...) -> R;` inside the extern block.
fn rust_functions() -> Vec<RustFn> {
    let src = squeeze(RUST_SOURCE, "//");
    let block = &src[src.find("extern \"C\" {").expect("extern block")..];
    let mut fns = Vec::new();
    for part in block.split("pub fn ").skip(1) {
        let decl = &part[..part.find(';').expect("; after a declaration")];
        let open = decl.find('(').unwrap();
        let close = decl.rfind(')').unwrap();
        let name = decl[..open].trim().to_string();
        let params = decl[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (n, t) = p.split_once(':').expect("name: type");
                (n.trim().to_string(), t.trim().to_string())
            })
            .collect();
        let ret = decl[close + 1..]
            .trim()
            .strip_prefix("->")
            .map(|r| r.trim().to_string());
        fns.push(RustFn { name, params, ret });
    }
    fns
}

// `pub struct name { pub field: type, ... }` for the structs with fields.
fn rust_structs() -> BTreeMap<String, Vec<(String, String)>> {
    let src = squeeze(RUST_SOURCE, "//");
    let mut structs = BTreeMap::new();
    for part in src.split("pub struct ").skip(1) {
        let name = part[..part.find(|c: char| !is_ident(c)).unwrap()].to_string();
        let body = &part[part.find('{').unwrap() + 1..part.find('}').unwrap()];
        let fields: Vec<(String, String)> = body
            .split(',')
            .map(str::trim)
            .filter_map(|f| f.strip_prefix("pub "))
            .map(|f| {
                let (n, t) = f.split_once(':').unwrap();
                (n.trim().to_string(), t.trim().to_string())
            })
            .collect();
        if !fields.is_empty() {
            structs.insert(name, fields);
        }
    }
    structs
}

fn rust_const_names() -> Vec<String> {
    let src = squeeze(RUST_SOURCE, "//");
    src.split("pub const ")
        .skip(1)
        .map(|p| p[..p.find(':').unwrap()].trim().to_string())
        .collect()
}

// The functions the header marks WKV_API.
fn header_functions(header: &str) -> Vec<String> {
    let text = squeeze(header, "//");
    text.split("WKV_API ")
        .skip(1)
        .filter_map(|p| {
            let before = p[..p.find('(')?].trim_end();
            let name = before.rsplit(|c: char| !is_ident(c)).next()?;
            if name.starts_with("wkv_") {
                Some(name.to_string())
            } else {
                None // the definitions of WKV_API itself
            }
        })
        .collect()
}

// The WKV_* constants the header defines: enumerators and version macros.
fn header_constants(header: &str) -> Vec<String> {
    let text = squeeze(header, "//");
    let mut names = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("WKV_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
        let name = &tail[..end];
        let after = tail[end..].trim_start();
        let before = rest[..i].trim_end();
        let enumerator = after.starts_with('=') && !after.starts_with("==");
        // An object-like macro; a function-like one has '(' right after.
        let define = before.ends_with("#define") && !tail[end..].starts_with('(');
        if (enumerator || define) && name != "WKV_API" && name != "WKV_H" {
            names.push(name.to_string());
        }
        rest = &tail[end..];
    }
    names
}

macro_rules! layout {
    ($map:ident, $ty:ident { $($field:ident),* $(,)? }) => {{
        let base = mem::MaybeUninit::<$ty>::uninit();
        let p = base.as_ptr();
        $map.insert(format!("sizeof {}", stringify!($ty)), mem::size_of::<$ty>() as i64);
        $map.insert(format!("alignof {}", stringify!($ty)), mem::align_of::<$ty>() as i64);
        let mut names: Vec<&str> = Vec::new();
        $(
            // SAFETY: addr_of! computes a field's address without reading.
            let f = unsafe { std::ptr::addr_of!((*p).$field) };
            $map.insert(
                format!("offsetof {}.{}", stringify!($ty), stringify!($field)),
                (f as usize - p as usize) as i64,
            );
            $map.insert(
                format!("sizeof {}.{}", stringify!($ty), stringify!($field)),
                size_of_pointee(f) as i64,
            );
            names.push(stringify!($field));
        )*
        (stringify!($ty), names)
    }};
}

fn size_of_pointee<T>(_: *const T) -> usize {
    mem::size_of::<T>()
}

macro_rules! constants {
    ($map:ident, $($name:ident),* $(,)?) => {{
        let mut names: Vec<&str> = Vec::new();
        $(
            $map.insert(format!("const {}", stringify!($name)), $name as i64);
            names.push(stringify!($name));
        )*
        names
    }};
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn declarations_match_the_header() {
    let header = header_text();
    let fns = rust_functions();
    let structs = rust_structs();

    // 1. The same functions and constants on both sides.
    let rust_fn_names = sorted(fns.iter().map(|f| f.name.clone()).collect());
    assert_eq!(
        rust_fn_names,
        sorted(header_functions(&header)),
        "functions differ"
    );
    assert_eq!(
        sorted(rust_const_names()),
        sorted(header_constants(&header)),
        "constants differ"
    );

    // What Rust says, to compare with what C prints.
    let mut rust: BTreeMap<String, i64> = BTreeMap::new();
    let mut checked = vec![
        layout!(
            rust,
            wkv_config {
                size,
                device,
                device_id,
                n_layers,
                n_q_heads,
                n_kv_heads,
                head_dim,
                dtype,
                segment_tokens,
                update_segment_tokens,
                cluster_tokens,
                kmeans_iters,
                sink_tokens,
                window_tokens,
                retrieval_frac,
                estimation_frac,
                page_bytes,
                threads,
                flags,
                page_format,
                host_budget_bytes,
                host_chunk_bytes,
                device_cache_bytes,
                seed,
                stats_path,
                stats_interval_ms,
                method,
                reserved1,
                spill_dir,
                spill_budget_bytes,
            }
        ),
        layout!(
            rust,
            wkv_stats {
                size,
                device,
                sequences,
                tokens,
                segments,
                clusters,
                host_bytes_reserved,
                host_bytes_used,
                host_budget_bytes,
                page_bytes,
                pages_used,
                pages_free,
                steady_bytes,
                meta_bytes,
                lookups,
                retrieved_clusters,
                estimated_clusters,
                attended_tokens,
                cache_hits,
                cache_misses,
                device_cache_bytes,
                kmeans_ns,
                cache_admissions,
                cache_evictions,
                manager_backlog,
                pin_fallbacks,
                spill_io,
                spill_bytes_used,
                spill_file_bytes,
                spill_budget_bytes,
                spill_bytes_written,
                spill_bytes_read,
                evicted_sequences,
                spill_cold_pages,
                spill_pages_written,
                spill_pages_read,
                spill_estimated,
                spill_read_errors,
                spill_write_errors,
                cache_frames_given,
                cache_records_dropped,
                growths_deferred,
                growth_waits,
                decode_graphs,
                device_bytes_reserved,
                device_bytes_used,
                meta_device_bytes,
                meta_host_rows_reserved,
            }
        ),
        layout!(
            rust,
            wkv_seq_info {
                size,
                generating,
                tokens,
                clustered,
                sink,
                tail,
                segments,
                clusters,
                pages,
                evicted,
                reserved,
                spilled_pages,
            }
        ),
        layout!(
            rust,
            wkv_xbuf_view {
                size,
                n_runs,
                n_tokens,
                head_dim,
                dtype,
                k,
                v,
                offsets
            }
        ),
    ];
    checked.sort();
    // The lists above name every field of src/lib.rs's structs, in order.
    let parsed: Vec<(&str, Vec<&str>)> = structs
        .iter()
        .map(|(s, fields)| (s.as_str(), fields.iter().map(|f| f.0.as_str()).collect()))
        .collect();
    assert_eq!(checked, parsed, "the layout! lists differ from src/lib.rs");
    let const_names = constants!(
        rust,
        WKV_VERSION_MAJOR,
        WKV_VERSION_MINOR,
        WKV_VERSION_PATCH,
        WKV_VERSION_NUMBER,
        WKV_OK,
        WKV_ERR_INVALID_ARGUMENT,
        WKV_ERR_INVALID_HANDLE,
        WKV_ERR_OUT_OF_RANGE,
        WKV_ERR_UNSUPPORTED,
        WKV_ERR_BUDGET,
        WKV_ERR_OUT_OF_MEMORY,
        WKV_ERR_DEVICE,
        WKV_ERR_IO,
        WKV_ERR_CORRUPT,
        WKV_ERR_STATE,
        WKV_ERR_INTERNAL,
        WKV_ERR_NO_DEVICE,
        WKV_DTYPE_F32,
        WKV_DTYPE_F16,
        WKV_DTYPE_BF16,
        WKV_DEVICE_CPU,
        WKV_DEVICE_CUDA,
        WKV_DEVICE_AUTO,
        WKV_CONFIG_NO_NUMA,
        WKV_CONFIG_NO_PINNED,
        WKV_CONFIG_SPILL_NO_URING,
        WKV_CONFIG_HOST_META_ROWS,
        WKV_SPILL_IO_URING,
        WKV_SPILL_IO_DIRECT,
        WKV_SAVE_NO_FSYNC,
        WKV_METHOD_OUTLIERS,
        WKV_METHOD_ONES,
        WKV_METHOD_SPREAD,
        WKV_METHOD_TAIL,
        WKV_METHOD_PAPER,
        WKV_METHOD_DEFAULT,
        WKV_PAGE_FORMAT_STORAGE,
        WKV_PAGE_FORMAT_INT8,
        WKV_PAGE_FORMAT_INT8_CENTERED,
    );
    assert_eq!(
        sorted(const_names.iter().map(|s| s.to_string()).collect()),
        sorted(rust_const_names()),
        "the constants! list differs from src/lib.rs"
    );

    // 2.-4. One C program: the prototypes, the field type checks, and what
    // it prints.
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <wavekv/wavekv.h>\n\n\
         /* Rust's prototypes: a conflict with the header is an error. */\n",
    );
    for f in &fns {
        let ret = f.ret.as_deref().map_or("void".to_string(), c_type);
        let params = if f.params.is_empty() {
            "void".to_string()
        } else {
            f.params
                .iter()
                .map(|(n, t)| format!("{} {}", c_type(t), n))
                .collect::<Vec<_>>()
                .join(", ")
        };
        c += &format!("{} {}({});\n", ret, f.name, params);
    }
    c += "\n/* Rust's field types: an incompatible pointer is an error. */\n";
    for (s, fields) in &structs {
        c += &format!(
            "void check_{}(void);\nvoid check_{}(void) {{\n  {} x;\n",
            s, s, s
        );
        for (i, (name, ty)) in fields.iter().enumerate() {
            c += &format!("  {} *p{} = &x.{};\n  (void)p{};\n", c_type(ty), i, name, i);
        }
        c += "}\n";
    }
    c += "\nint main(void) {\n";
    for (s, fields) in &structs {
        c += &format!("  printf(\"sizeof {} %zu\\n\", sizeof({}));\n", s, s);
        c += &format!(
            "  printf(\"alignof {} %zu\\n\", offsetof(struct {{ char c; {} x; }}, x));\n",
            s, s
        );
        for (name, _) in fields {
            c += &format!(
                "  printf(\"offsetof {}.{} %zu\\n\", offsetof({}, {}));\n",
                s, name, s, name
            );
            c += &format!(
                "  printf(\"sizeof {}.{} %zu\\n\", sizeof(((const {} *)0)->{}));\n",
                s, name, s, name
            );
        }
    }
    for name in &const_names {
        c += &format!(
            "  printf(\"const {} %lld\\n\", (long long)({}));\n",
            name, name
        );
    }
    c += "  return 0;\n}\n";

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("wavekv-sys-header");
    fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    fs::write(&src, &c).unwrap();
    let cc = env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror"])
        .arg(format!("-I{}", include_dir().display()))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler {:?}: {}", cc, e));
    assert!(
        out.status.success(),
        "the C compiler refused the Rust declarations ({}):\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let mut from_c: BTreeMap<String, i64> = BTreeMap::new();
    for line in String::from_utf8(run.stdout).unwrap().lines() {
        let (key, value) = line.rsplit_once(' ').unwrap();
        from_c.insert(key.to_string(), value.parse().unwrap());
    }
    assert_eq!(rust, from_c, "layouts or constants differ from the header");
}
