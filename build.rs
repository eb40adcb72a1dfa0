//! Generates the crate's own bindings to libibverbs and librdmacm from the system headers.
//!
//! * `bindgen` reads `infiniband/verbs.h` and `rdma/rdma_cma.h` and emits Rust declarations.
//! * The `static inline` verbs (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`, ...) have no
//!   symbol in the shared libraries. bindgen's `wrap_static_fns` writes a C file with one
//!   exported wrapper per inline function; we compile it with `cc` against the same headers, so
//!   the inline bodies come from rdma-core itself and are never re-implemented in Rust.
//!
//! Missing prerequisites stop the build with a message naming the Debian package to install.
//!
//! With `DOCS_RS` set (docs.rs, which has no rdma-core headers) it reads no header and compiles
//! nothing: the bindings committed in `src/sys/bindings_docs_rs.rs` are used instead.

#![allow(clippy::print_stdout, clippy::print_stderr)] // a build script talks to cargo on stdout

use std::env;
use std::path::{Path, PathBuf};

const HEADERS: &[(&str, &str)] = &[
    ("infiniband/verbs.h", "libibverbs-dev"),
    ("rdma/rdma_cma.h", "librdmacm-dev"),
];

/// The bindings committed for builds without the rdma-core headers (docs.rs): `bindings.rs`
/// as this script generates it; `scripts/test` checks they equal freshly generated ones.
const DOCS_RS_BINDINGS: &str = "src/sys/bindings_docs_rs.rs";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");
    println!("cargo:rerun-if-env-changed=RDMA_CORE_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=DOCS_RS");

    if env::var_os("DOCS_RS").is_some() {
        docs_rs();
        return;
    }

    let include_dirs = include_dirs();
    for (header, package) in HEADERS {
        match include_dirs.iter().find(|d| d.join(header).is_file()) {
            Some(dir) => println!("cargo:rerun-if-changed={}", dir.join(header).display()),
            None => fail(&format!(
                "header <{header}> not found in {include_dirs:?}.\n\
                 Install it with: apt-get install {package}\n\
                 (or point RDMA_CORE_INCLUDE_DIR at an rdma-core include directory)"
            )),
        }
    }

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let wrappers = out.join("static_wrappers");

    let mut builder = bindgen::Builder::default()
        .header_contents(
            "tokio_rdma_wrapper.h",
            "#include <infiniband/verbs.h>\n#include <rdma/rdma_cma.h>\n",
        )
        .allowlist_function("ibv_.*")
        .allowlist_function("rdma_.*")
        .allowlist_function("___ibv_query_port")
        .allowlist_type("ibv_.*")
        .allowlist_type("rdma_.*")
        // `ibv_advise_mr`'s advice and flags are macros naming these kernel ABI enums.
        .allowlist_type("ib_uverbs_advise_mr_.*")
        .allowlist_var("IBV_.*")
        .allowlist_var("RDMA_.*")
        // Deprecated or compat entry points we never want to call by mistake.
        .blocklist_function("ibv_.*_compat.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(false)
        .layout_tests(false)
        .generate_comments(false)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrappers)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for dir in &include_dirs {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }

    // bindgen loads libclang at run time and panics if it cannot; turn that into a clear message.
    let generated =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate()));
    let bindings = match generated {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => fail(&format!(
            "bindgen could not parse the rdma-core headers: {e}\n\
             Is libclang installed? apt-get install libclang-dev (or libclang-19-dev and \
             LIBCLANG_PATH=/usr/lib/llvm-19/lib)"
        )),
        Err(_) => fail(
            "bindgen could not load libclang.\n\
             Install it with: apt-get install libclang-dev\n\
             (or another version, e.g. libclang-19-dev, selected with LIBCLANG_PATH=/usr/lib/llvm-19/lib)",
        ),
    };
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs");

    // Compile the wrappers of the static inline verbs with the same headers.
    let c_file = wrappers.with_extension("c");
    let mut cc = cc::Build::new();
    cc.file(&c_file)
        .flag("-include")
        .flag("infiniband/verbs.h")
        .flag("-include")
        .flag("rdma/rdma_cma.h")
        .warnings(false)
        .opt_level(2);
    for dir in &include_dirs {
        cc.include(dir);
    }
    cc.compile("tokio_rdma_static_wrappers");

    println!("cargo:rustc-link-lib=dylib=ibverbs");
    println!("cargo:rustc-link-lib=dylib=rdmacm");
}

/// docs.rs builds the documentation without rdma-core's headers (and links nothing): the
/// committed bindings stand in for generated ones; no header is read, no C compiled. The
/// wrappers of the inline verbs are only declared there (their `__extern` link names), which
/// is all `rustdoc` needs.
fn docs_rs() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let src = manifest.join(DOCS_RS_BINDINGS);
    println!("cargo:rerun-if-changed={}", src.display());
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    if let Err(e) = std::fs::copy(&src, out.join("bindings.rs")) {
        fail(&format!(
            "DOCS_RS is set but {} cannot be copied: {e}",
            src.display()
        ));
    }
}

/// Include directories to search: `RDMA_CORE_INCLUDE_DIR` first, then the system defaults.
fn include_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = env::var_os("RDMA_CORE_INCLUDE_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    for d in ["/usr/include", "/usr/local/include"] {
        if Path::new(d).is_dir() {
            dirs.push(PathBuf::from(d));
        }
    }
    dirs
}

fn fail(msg: &str) -> ! {
    for line in msg.lines() {
        println!("cargo:warning=tokio-rdma: {line}");
    }
    eprintln!("\ntokio-rdma build error:\n{msg}\n");
    std::process::exit(1);
}
