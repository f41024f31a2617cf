// The integration tests find libwavekv.so through an rpath to the directory
// that wavekv-sys linked against (WAVEKV_LIB_DIR, see wavekv-sys/build.rs).
// Doctests cannot take link arguments: they need LD_LIBRARY_PATH or an
// installed library.
use std::env;

fn main() {
    if let Some(dir) = env::var_os("DEP_WAVEKV_LIB_DIR") {
        println!(
            "cargo:rustc-link-arg-tests=-Wl,-rpath,{}",
            dir.to_string_lossy()
        );
    }
}
