//! With the cargo feature `mpi`: compiles `mpi/shim.c` against the installed MPI (Open MPI or
//! MPICH, found through its `mpicc` wrapper: `CACHALOT_MPICC`, else `mpicc` on the PATH) and
//! links its library. Without the feature it does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=mpi/shim.c");
    println!("cargo:rerun-if-env-changed=CACHALOT_MPICC");
    // `mpicc` is looked up on the PATH: another MPI there is another build.
    println!("cargo:rerun-if-env-changed=PATH");
    #[cfg(feature = "mpi")]
    mpi::build();
}

#[cfg(feature = "mpi")]
mod mpi {
    use std::process::Command;

    /// The words a wrapper prints for one of its info options, `None` when it cannot run or fails.
    fn wrapper_words(mpicc: &str, option: &str) -> Option<Vec<String>> {
        let out = Command::new(mpicc).arg(option).output().ok()?;
        if !out.status.success() {
            return None;
        }
        let text = String::from_utf8(out.stdout).ok()?;
        Some(text.split_whitespace().map(str::to_string).collect())
    }

    pub fn build() {
        let mpicc = std::env::var("CACHALOT_MPICC").unwrap_or_else(|_| "mpicc".to_string());
        // Open MPI: --showme:compile / --showme:link print the flags alone. MPICH: -compile_info
        // / -link_info print a whole command line, the compiler first.
        let (compile, link) = match (
            wrapper_words(&mpicc, "--showme:compile"),
            wrapper_words(&mpicc, "--showme:link"),
        ) {
            (Some(c), Some(l)) => (c, l),
            _ => match (
                wrapper_words(&mpicc, "-compile_info"),
                wrapper_words(&mpicc, "-link_info"),
            ) {
                (Some(c), Some(l)) => (
                    c.into_iter().skip(1).collect::<Vec<_>>(),
                    l.into_iter().skip(1).collect::<Vec<_>>(),
                ),
                _ => panic!(
                    "cargo feature `mpi`: cannot ask `{mpicc}` for MPI's flags (neither Open MPI's \
                     --showme:compile nor MPICH's -compile_info answered). Install an MPI \
                     (Debian: apt-get install libopenmpi-dev openmpi-bin) or set CACHALOT_MPICC \
                     to its mpicc, or build without --features mpi"
                ),
            },
        };
        let mut cc = cc::Build::new();
        cc.file("mpi/shim.c").warnings(true);
        for w in &compile {
            if let Some(dir) = w.strip_prefix("-I") {
                cc.include(dir);
            } else if let Some(def) = w.strip_prefix("-D") {
                match def.split_once('=') {
                    Some((k, v)) => cc.define(k, v),
                    None => cc.define(def, None),
                };
            } else if w.starts_with("-pthread") {
                cc.flag(w);
            }
        }
        cc.compile("cachalot_mpi_shim");
        for w in &link {
            if let Some(dir) = w.strip_prefix("-L") {
                println!("cargo:rustc-link-search=native={dir}");
            } else if let Some(lib) = w.strip_prefix("-l") {
                println!("cargo:rustc-link-lib={lib}");
            } else if let Some(lib) = library_path(w) {
                // A library named by its path (some MPICH builds), versioned or not.
                let (dir, name) = lib;
                println!("cargo:rustc-link-search=native={dir}");
                println!("cargo:rustc-link-lib={name}");
            }
        }
        // An MPI outside the loader's paths (e.g. under /opt) needs LD_LIBRARY_PATH at run time
        // (README); this crate's own tests and examples get its rpath.
        for dir in rpaths(&link) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }

    /// `/dir/libNAME.so`, `.so.12` or `.a` as (dir, NAME).
    fn library_path(w: &str) -> Option<(String, String)> {
        let p = std::path::Path::new(w);
        let file = p.file_name()?.to_str()?;
        let stem = file.strip_prefix("lib")?;
        let name = match stem.find(".so") {
            Some(i) if stem[i + 3..].is_empty() || stem[i + 3..].starts_with('.') => &stem[..i],
            _ => stem.strip_suffix(".a")?,
        };
        Some((p.parent()?.display().to_string(), name.to_string()))
    }

    /// The run paths the wrapper passes to the linker (`-Wl,-rpath,DIR`, `-Wl,-rpath -Wl,DIR`,
    /// `-Wl,-rpath=DIR`).
    fn rpaths(link: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        let mut next_is_dir = false;
        for w in link {
            let Some(args) = w.strip_prefix("-Wl,") else {
                continue;
            };
            for a in args.split(',') {
                if next_is_dir {
                    out.push(a.to_string());
                    next_is_dir = false;
                } else if a == "-rpath" || a == "--rpath" {
                    next_is_dir = true;
                } else if let Some(d) = a.strip_prefix("-rpath=").or(a.strip_prefix("--rpath=")) {
                    out.push(d.to_string());
                }
            }
        }
        out.retain(|d| !d.is_empty());
        out
    }
}
