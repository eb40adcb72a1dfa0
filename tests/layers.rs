//! The crate's shape, checked: the module graph of `src/` (every `use` and `crate::`/`super::`
//! path of non-test code) has no cycle among the files of any directory (`conn`, `driver`,
//! `proto`, `buf`, `verbs`, `ops`, `error` and all below them), and the top-level modules
//! depend only downward:
//!
//! ```text
//! sys -> verbs -> proto -> driver -> buf -> ops -> conn -> endpoint -> lib.rs (re-exports)
//! ```
//!
//! plus two shared leaves everyone may use: `sync` (depends on nothing in the crate) and
//! `error` (depends on `sys` and `verbs` only: it names verbs' value types, and verbs returns
//! its `Error`). docs/architecture.md draws the same picture. A cycle or an upward edge that is
//! not in the allow-lists below fails the test, naming the cycle and the references that make
//! it; an allow-listed one that is gone fails too, so the list only shrinks.
//!
//! How a reference is resolved: `crate::`, `super::`, `self::` and child-module paths, and
//! names brought in by `use`, to the longest module prefix; a name there that the module
//! itself re-exports (`pub use x::Y`, or a private `use` its children reach through `super::`)
//! is followed to where it is defined. A `pub use` is a pass-through, no dependency of the
//! re-exporting module, unless that module uses the name itself. Comments, doc links and
//! string literals are not read; items under `#[cfg(test)]` (or `cfg(all(test, ..))`) are cut.
#![allow(clippy::print_stdout)]

#[path = "layers/parse.rs"]
mod parse;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

use parse::{FileRefs, file_refs};

/// The top-level layers, lowest first: a module may use those before it.
const LAYERS: &[&str] = &[
    "sys", "verbs", "proto", "driver", "buf", "ops", "owned", "conn", "endpoint",
];

/// Modules every layer may use, with the only modules they may use themselves.
const LEAVES: &[(&str, &[&str])] = &[
    ("sync", &[]),
    ("test_task", &[]),
    ("error", &["sys", "verbs"]),
];

/// Directories (and all directories under them) whose files must not form a cycle: every
/// directory of the crate.
const ACYCLIC: &[&str] = &[
    "buf", "conn", "driver", "error", "ops", "owned", "proto", "sys", "verbs",
];

/// Cycles that still exist, as `dir: member member ..` (members sorted; `(dir)` is the
/// directory's `mod.rs`). Shrink only.
const KNOWN_CYCLES: &[&str] = &[];

/// Upward top-level edges that still exist, as `from -> to`. Shrink only.
const KNOWN_UPWARD: &[&str] = &[];

type ModPath = Vec<String>;

fn show(m: &[String]) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

/// The crate's module tree, read from the files.
struct Crate {
    files: BTreeMap<ModPath, (PathBuf, FileRefs)>,
}

impl Crate {
    /// Reads `root/lib.rs` and every non-test `mod x;` below it.
    fn load(root: &Path) -> Crate {
        let mut files = BTreeMap::new();
        let mut todo = vec![(Vec::new(), root.join("lib.rs"))];
        while let Some((m, file)) = todo.pop() {
            let src = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            let refs = file_refs(&src);
            let name = file.file_stem().unwrap().to_str().unwrap();
            let dir = if name == "lib" || name == "mod" {
                file.parent().unwrap().to_path_buf()
            } else {
                file.with_extension("")
            };
            for child in &refs.mods {
                let flat = dir.join(format!("{child}.rs"));
                let f = if flat.exists() {
                    flat
                } else {
                    dir.join(child).join("mod.rs")
                };
                let mut cm: ModPath = m.clone();
                cm.push(child.clone());
                todo.push((cm, f));
            }
            files.insert(m, (file, refs));
        }
        Crate { files }
    }

    fn is_child(&self, m: &[String], name: &str) -> bool {
        self.files[m].1.mods.iter().any(|c| c == name)
    }

    /// The absolute path a path written in module `m` names, if it names something in this
    /// crate.
    fn absolute(&self, m: &[String], path: &[String], depth: usize) -> Option<ModPath> {
        let first = path.first()?;
        match first.as_str() {
            "crate" => Some(path[1..].to_vec()),
            "self" | "super" => {
                let mut base = m.to_vec();
                let mut i = 0;
                while i < path.len() && (path[i] == "self" || path[i] == "super") {
                    if path[i] == "super" {
                        base.pop()?;
                    }
                    i += 1;
                }
                base.extend_from_slice(&path[i..]);
                Some(base)
            }
            name if self.is_child(m, name) => {
                let mut p = m.to_vec();
                p.extend_from_slice(path);
                Some(p)
            }
            name if depth < 16 => {
                let item = self.files[m].1.uses.iter().find(|u| {
                    u.alias == name && u.path.first().map(String::as_str) != Some(name)
                })?;
                let mut p = self.absolute(m, &item.path, depth + 1)?;
                p.extend_from_slice(&path[1..]);
                Some(p)
            }
            _ => None,
        }
    }

    /// The module that defines what the absolute path `abs` names (re-exports followed).
    fn target(&self, abs: &[String], depth: usize) -> Option<ModPath> {
        let mut len = abs.len();
        while !self.files.contains_key(&abs[..len]) {
            len -= 1;
        }
        let m = abs[..len].to_vec();
        if len == abs.len() || depth > 16 {
            return Some(m);
        }
        let name = &abs[len];
        let via = self.files[&m].1.uses.iter().find(|u| &u.alias == name);
        match via.and_then(|u| self.absolute(&m, &u.path, depth + 1)) {
            Some(mut p) => {
                p.extend_from_slice(&abs[len + 1..]);
                self.target(&p, depth + 1)
            }
            None => Some(m),
        }
    }

    /// Every module-to-module dependency, with one reference that makes it.
    fn edges(&self) -> BTreeMap<(ModPath, ModPath), String> {
        let mut out = BTreeMap::new();
        for (m, (_, refs)) in &self.files {
            let mut add = |path: &[String]| {
                let Some(abs) = self.absolute(m, path, 0) else {
                    return;
                };
                let Some(t) = self.target(&abs, 0) else {
                    return;
                };
                if t != *m {
                    out.entry((m.to_vec(), t))
                        .or_insert_with(|| format!("{}: {}", show(m), path.join("::")));
                }
            };
            for u in &refs.uses {
                let passthrough = u.public && !refs.words.contains(&u.alias);
                if !passthrough && u.alias != "*" {
                    add(&u.path);
                }
            }
            for p in &refs.paths {
                add(p);
            }
        }
        out
    }
}

/// A dependency graph between named nodes, each edge with the reference that makes it.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// Strongly connected components of more than one node (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct St<'a> {
        g: &'a Graph,
        idx: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut St<'a>, v: &'a str) {
        let n = s.idx.len();
        s.idx.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        if let Some(ws) = s.g.get(v) {
            for w in ws.keys() {
                if !s.idx.contains_key(w.as_str()) {
                    visit(s, w);
                    let lw = s.low[w.as_str()];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if s.on.contains(w.as_str()) {
                    let iw = s.idx[w.as_str()];
                    let lv = s.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if s.low[v] == s.idx[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = St {
        g,
        idx: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.idx.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// One shortest cycle through `comp`'s first node, with the reference behind each step.
fn explain(g: &Graph, comp: &[String]) -> String {
    let start = &comp[0];
    let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
    let mut q = VecDeque::from([start.as_str()]);
    let mut end = None;
    'bfs: while let Some(v) = q.pop_front() {
        for w in g[v].keys() {
            if !comp.contains(w) {
                continue;
            }
            if w == start {
                end = Some(v);
                break 'bfs;
            }
            if !prev.contains_key(w.as_str()) {
                prev.insert(w, v);
                q.push_back(w);
            }
        }
    }
    let mut hops = vec![end.unwrap()];
    while *hops.last().unwrap() != start.as_str() {
        hops.push(prev[hops.last().unwrap()]);
    }
    hops.reverse();
    hops.push(start);
    let mut text = hops.join(" -> ");
    for pair in hops.windows(2) {
        text.push_str(&format!(
            "\n      {} -> {}: {}",
            pair[0], pair[1], g[pair[0]][pair[1]]
        ));
    }
    text
}

/// An acyclic graph's nodes by level, lowest first (a node's level is one above its highest
/// dependency's), for the report.
fn levels(g: &Graph, nodes: &BTreeSet<String>) -> String {
    fn level(g: &Graph, n: &str, memo: &mut BTreeMap<String, usize>) -> usize {
        if let Some(l) = memo.get(n) {
            return *l;
        }
        let l = g.get(n).map_or(0, |ds| {
            ds.keys().map(|d| level(g, d, memo) + 1).max().unwrap_or(0)
        });
        memo.insert(n.to_string(), l);
        l
    }
    let mut memo = BTreeMap::new();
    let mut by: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for n in nodes {
        by.entry(level(g, n, &mut memo)).or_default().push(n);
    }
    by.values()
        .map(|v| v.join(" "))
        .collect::<Vec<_>>()
        .join(" < ")
}

/// What the check found in the crate under `root` (its `src`), as (kind, key, explanation):
/// kind "cycle" with key `dir: members`, kind "upward" with key `from -> to` (the problems),
/// and kind "order" with key `dir`: an acyclic directory's entries by level (information).
fn check(root: &Path) -> Vec<(&'static str, String, String)> {
    let krate = Crate::load(root);
    let edges = krate.edges();
    let mut found = Vec::new();

    // (a) No cycle among the entries (files and subdirectories) of one directory.
    let dirs: Vec<&ModPath> = krate
        .files
        .keys()
        .filter(|m| !m.is_empty() && ACYCLIC.contains(&m[0].as_str()))
        .filter(|m| !krate.files[*m].1.mods.is_empty())
        .collect();
    for d in dirs {
        let node = |m: &ModPath| -> Option<String> {
            if m == d {
                Some(format!("({})", d.last().unwrap()))
            } else if m.len() > d.len() && m.starts_with(d) {
                Some(m[d.len()].clone())
            } else {
                None
            }
        };
        let mut g = Graph::new();
        for ((a, b), why) in &edges {
            if let (Some(na), Some(nb)) = (node(a), node(b)) {
                if na != nb {
                    g.entry(na).or_default().entry(nb).or_insert(why.clone());
                }
            }
        }
        let comps = cycles(&g);
        if comps.is_empty() {
            let nodes: BTreeSet<String> = krate.files.keys().filter_map(&node).collect();
            found.push(("order", show(d), levels(&g, &nodes)));
        }
        for comp in comps {
            let key = format!("{}: {}", show(d), comp.join(" "));
            found.push(("cycle", key, explain(&g, &comp)));
        }
    }

    // (b) Top-level modules depend only downward (or on a leaf).
    let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
    let mut seen = BTreeSet::new();
    for ((a, b), why) in &edges {
        let (Some(ta), Some(tb)) = (a.first(), b.first()) else {
            if !a.is_empty() && b.is_empty() {
                found.push(("upward", format!("{} -> crate", a[0]), why.clone()));
            }
            continue;
        };
        if ta == tb || !seen.insert((ta.clone(), tb.clone())) {
            continue;
        }
        let ok = if let Some((_, may)) = LEAVES.iter().find(|(l, _)| l == ta) {
            may.contains(&tb.as_str())
        } else if LEAVES.iter().any(|(l, _)| l == tb) {
            true
        } else {
            match (rank(ta), rank(tb)) {
                (Some(x), Some(y)) => y < x,
                _ => false,
            }
        };
        if !ok {
            found.push(("upward", format!("{ta} -> {tb}"), why.clone()));
        }
    }
    found
}

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn modules_form_no_cycle_and_layers_point_down() {
    // TOKIO_RDMA_LAYERS_SRC checks another tree (e.g. an older commit's `src`, exported).
    let src = std::env::var_os("TOKIO_RDMA_LAYERS_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest().join("src"));
    let found = check(&src);
    let mut failures = Vec::new();
    for (kind, key, why) in &found {
        if *kind == "order" {
            println!("order {key}: {why}");
            continue;
        }
        let known = match *kind {
            "cycle" => KNOWN_CYCLES.contains(&key.as_str()),
            _ => KNOWN_UPWARD.contains(&key.as_str()),
        };
        println!(
            "{kind} {key}{}\n      {why}",
            if known { " (allow-listed)" } else { "" }
        );
        if !known {
            failures.push(format!("new {kind}: {key}\n      {why}"));
        }
    }
    for key in KNOWN_CYCLES {
        if !found.iter().any(|(k, f, _)| *k == "cycle" && f == key) {
            failures.push(format!(
                "allow-listed cycle is gone, remove it from KNOWN_CYCLES: {key}"
            ));
        }
    }
    for key in KNOWN_UPWARD {
        if !found.iter().any(|(k, f, _)| *k == "upward" && f == key) {
            failures.push(format!(
                "allow-listed edge is gone, remove it from KNOWN_UPWARD: {key}"
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Writes a small crate tree under a fresh temporary directory.
fn fixture(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let root =
        std::env::temp_dir().join(format!("tokio-rdma-layers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for (path, text) in files {
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    root
}

#[test]
fn the_checker_names_a_cycle_and_an_upward_edge() {
    let root = fixture(
        "bad",
        &[
            ("lib.rs", "pub mod conn;\nmod verbs;\npub use conn::A;\n"),
            ("conn/mod.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n"),
            // a -> b through a group import, b -> c through an expression path, c -> a
            // through the parent's re-export.
            (
                "conn/a.rs",
                "use super::{b::{self, B}};\npub struct A(B);\n",
            ),
            ("conn/b.rs", "pub struct B;\nfn f() { super::c::g() }\n"),
            (
                "conn/c.rs",
                "/// [`super::b::B`] in a doc comment is no edge\npub fn g() { let _ = super::A; }\n",
            ),
            ("verbs.rs", "pub fn v() { crate::conn::A; }\n"),
        ],
    );
    let found: Vec<_> = check(&root)
        .into_iter()
        .filter(|f| f.0 != "order")
        .collect();
    let keys: Vec<&str> = found.iter().map(|(_, k, _)| k.as_str()).collect();
    assert_eq!(keys, ["conn: a b c", "verbs -> conn"], "{found:#?}");
    assert!(found[0].2.starts_with("a -> b -> c -> a"), "{}", found[0].2);
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn test_code_comments_and_strings_are_not_dependencies() {
    let root = fixture(
        "clean",
        &[
            ("lib.rs", "mod conn;\n"),
            ("conn/mod.rs", "mod a;\nmod b;\n#[cfg(test)]\nmod tests;\n"),
            ("conn/a.rs", "use super::b::B;\npub fn a(_: B) {}\n"),
            (
                "conn/b.rs",
                "pub struct B;\n// super::a::a\n/* super::a::a */\nconst S: &str = \"super::a::a\";\n\
                 const R: &str = r#\"super::a::a\"#;\nfn l<'a>(x: &'a str) -> char { let _ = x; 'x' }\n\
                 #[cfg(test)]\nmod tests {\n    use super::super::a::a;\n}\n\
                 #[cfg(all(test, loom))]\nfn model() { super::a::a(super::B) }\n",
            ),
        ],
    );
    let found = check(&root);
    assert_eq!(found.len(), 1, "{found:#?}");
    assert_eq!(
        (found[0].0, found[0].2.as_str()),
        ("order", "(conn) b < a"),
        "{found:#?}"
    );
    let _ = std::fs::remove_dir_all(root);
}
