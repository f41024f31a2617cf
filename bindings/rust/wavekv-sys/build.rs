// Where the linker finds libwavekv.so:
//   WAVEKV_LIB_DIR  a directory holding it (a build tree's lib/); the crate's
//                   own test binaries get it as their rpath, and dependents
//                   read it as DEP_WAVEKV_LIB_DIR;
//   otherwise       pkg-config's wavekv.pc if it is found, else the system
//                   library directories (after `make install`).
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn pkg_config_libdir() -> Option<PathBuf> {
    let out = Command::new("pkg-config")
        .args(["--variable=libdir", "wavekv"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = String::from_utf8(out.stdout).ok()?.trim().to_string();
    if dir.is_empty() {
        None
    } else {
        Some(PathBuf::from(dir))
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=WAVEKV_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let dir = match env::var_os("WAVEKV_LIB_DIR") {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => pkg_config_libdir(),
    };
    if let Some(dir) = dir {
        let dir = dir.canonicalize().unwrap_or(dir);
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        println!("cargo:lib_dir={}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib=wavekv");
}
