//! Host checks of the documentation (no device needed): the code blocks of the guide and of
//! docs/ecosystem.md are quoted verbatim from the examples they name, every guide example and
//! every scenario of examples/stack is smoke-run by `scripts/test`, and every relative link
//! and `examples/...` path in README.md and docs/ exists.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The ```rust blocks of a markdown text, as lists of lines.
fn rust_blocks(md: &str) -> Vec<Vec<&str>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in md.lines() {
        let t = line.trim();
        match current.as_mut() {
            None if t == "```rust" => current = Some(Vec::new()),
            Some(_) if t == "```" => blocks.push(current.take().unwrap()),
            Some(b) => b.push(line),
            None => {}
        }
    }
    blocks
}

/// Whether `chunk` (trimmed lines) occurs as a contiguous run in `lines` at or after `from`;
/// returns where it ends.
fn find_run(lines: &[&str], chunk: &[&str], from: usize) -> Option<usize> {
    (from..=lines.len().saturating_sub(chunk.len()))
        .find(|&i| {
            chunk
                .iter()
                .zip(&lines[i..])
                .all(|(c, l)| c.trim() == l.trim())
        })
        .map(|i| i + chunk.len())
}

/// Checks that every ```rust block of `doc` (a path under the crate root) starts with
/// `// examples/...rs` and quotes that file verbatim (excerpts separated by `// ...`, in
/// order); returns the files quoted.
fn check_quotes(doc: &str) -> std::collections::BTreeSet<String> {
    let md = read(&root().join(doc));
    let mut quoted = std::collections::BTreeSet::new();
    for block in rust_blocks(&md) {
        let file = block[0]
            .trim()
            .strip_prefix("// ")
            .filter(|f| f.starts_with("examples/") && f.ends_with(".rs"))
            .unwrap_or_else(|| {
                panic!("a {doc} code block must start with `// examples/NAME.rs`: {block:?}")
            });
        let src = read(&root().join(file));
        let lines: Vec<&str> = src.lines().collect();
        let mut at = 0;
        // `// ...` separates excerpts, which must appear in this order in the file.
        for chunk in block[1..].split(|l| l.trim() == "// ...") {
            at = find_run(&lines, chunk, at).unwrap_or_else(|| {
                panic!("{doc} quotes lines that {file} does not have (in this order): {chunk:#?}")
            });
        }
        quoted.insert(file.to_string());
    }
    quoted
}

#[test]
fn the_guide_quotes_the_examples_verbatim() {
    let quoted = check_quotes("docs/guide.md");
    for step in guide_examples() {
        assert!(
            quoted.contains(&format!("examples/{step}.rs")),
            "the guide quotes no code of {step}"
        );
    }
}

/// docs/ecosystem.md (hyper, tonic, tokio-util over `RdmaStream`) quotes examples/stack, which
/// `scripts/test` runs on soft-RoCE: the glue it shows is the glue that is tested.
#[test]
fn the_ecosystem_page_quotes_the_stack_example_verbatim() {
    let quoted = check_quotes("docs/ecosystem.md");
    for file in ["net", "framed", "http", "grpc"] {
        assert!(
            quoted.contains(&format!("examples/stack/{file}.rs")),
            "docs/ecosystem.md quotes no code of examples/stack/{file}.rs"
        );
    }
    let script = read(&root().join("scripts/test"));
    assert!(
        script.contains("for s in framed http1 http2 grpc; do"),
        "scripts/test does not run every scenario of examples/stack"
    );
}

/// The guide's step examples, `guide_N_...`, by name.
fn guide_examples() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("guide_") && n.ends_with(".rs"))
        .map(|n| n.trim_end_matches(".rs").to_string())
        .collect();
    names.sort();
    assert!(names.len() >= 6, "the guide's six steps: {names:?}");
    names
}

#[test]
fn scripts_test_smoke_runs_every_guide_example() {
    let script = read(&root().join("scripts/test"));
    let list = script
        .lines()
        .find(|l| l.trim_start().starts_with("for name in pingpong"))
        .expect("the smoke list of scripts/test");
    for step in guide_examples() {
        assert!(
            list.split_whitespace()
                .any(|w| w.trim_end_matches(';') == step),
            "scripts/test does not smoke-run {step}"
        );
    }
}

#[test]
fn links_and_example_paths_in_the_docs_exist() {
    let mut files = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let mut missing = Vec::new();
    for file in &files {
        let text = read(file);
        let dir = file.parent().unwrap();
        // Markdown links `](target)` that are relative paths.
        for part in text.split("](").skip(1) {
            let target = part.split([')', '#']).next().unwrap();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if !dir.join(target).exists() {
                missing.push(format!("{}: link {target}", file.display()));
            }
        }
        // Paths of examples named in the text (`examples/NAME.rs`, `examples/NAME`).
        for part in text.split("examples/").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let glob = part[name.len()..].starts_with(['*', '?']);
            if name.is_empty() || name == "common" || glob {
                continue;
            }
            let exists = root().join(format!("examples/{name}.rs")).exists()
                || root().join(format!("examples/{name}")).is_dir();
            if !exists {
                missing.push(format!("{}: examples/{name}", file.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "pointers to files that do not exist: {missing:#?}"
    );
}
