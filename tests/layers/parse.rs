//! Reading a Rust source file just far enough to see its module references: comments and
//! literals blanked, `#[cfg(test)]` items cut, then a token stream from which `mod x;`
//! declarations, `use` trees and `a::b::c` paths are taken.

/// A token of the stripped source: an identifier, `::`, or any other single character.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Tok {
    Ident(String),
    PathSep,
    Sym(char),
}

/// Removes comments (doc comments included: a doc link is no dependency) and replaces string,
/// byte-string, raw-string and char literals by an empty placeholder, so nothing inside them is
/// read as code. Lifetimes (`'a`) are kept.
pub(crate) fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let n = c.len();
    let mut out = String::with_capacity(n);
    let mut i = 0;
    let ident_before = |i: usize| i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_');
    while i < n {
        if c[i] == '/' && i + 1 < n && c[i + 1] == '/' {
            while i < n && c[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c[i] == '/' && i + 1 < n && c[i + 1] == '*' {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && i + 1 < n && c[i + 1] == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && i + 1 < n && c[i + 1] == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
            continue;
        }
        // Raw strings: r"..", r#".."#, br"..": no escapes, closed by the same number of #.
        if !ident_before(i) && (c[i] == 'r' || (c[i] == 'b' && i + 1 < n && c[i + 1] == 'r')) {
            let mut j = if c[i] == 'b' { i + 2 } else { i + 1 };
            let mut hashes = 0;
            while j < n && c[j] == '#' {
                hashes += 1;
                j += 1;
            }
            if j < n && c[j] == '"' {
                j += 1;
                loop {
                    if j >= n {
                        break;
                    }
                    if c[j] == '"' && (0..hashes).all(|k| j + 1 + k < n && c[j + 1 + k] == '#') {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                out.push_str("\"\"");
                i = j;
                continue;
            }
        }
        if c[i] == '"' {
            i += 1;
            while i < n && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
            continue;
        }
        if c[i] == '\'' {
            // A char literal ('x', '\n', '\u{..}', '\''), not a lifetime ('a).
            if i + 1 < n && c[i + 1] == '\\' {
                let mut j = i + 2;
                while j < n && c[j] != '\'' {
                    j += 1;
                }
                if c[i + 2] == '\'' {
                    j = i + 3;
                    while j < n && c[j] != '\'' {
                        j += 1;
                    }
                }
                out.push_str("' '");
                i = j + 1;
                continue;
            }
            if i + 2 < n && c[i + 2] == '\'' {
                out.push_str("' '");
                i += 3;
                continue;
            }
        }
        out.push(c[i]);
        i += 1;
    }
    out
}

/// Splits stripped source into tokens.
pub(crate) fn tokens(code: &str) -> Vec<Tok> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            // Raw identifiers (r#type) are plain identifiers here.
            if word == "r" && i < c.len() && c[i] == '#' {
                i += 1;
                continue;
            }
            out.push(Tok::Ident(word));
        } else if ch == ':' && i + 1 < c.len() && c[i + 1] == ':' {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            out.push(Tok::Sym(ch));
            i += 1;
        }
    }
    out
}

/// Whether a `#[cfg(..)]` predicate holds only under `cfg(test)`: `test`, or an `all(..)` that
/// contains `test` (and no `not`).
fn test_only(pred: &[Tok]) -> bool {
    let has = |w: &str| pred.iter().any(|t| *t == Tok::Ident(w.into()));
    match pred.first() {
        Some(Tok::Ident(w)) if w == "test" => pred.len() == 1,
        Some(Tok::Ident(w)) if w == "all" => has("test") && !has("not") && !has("any"),
        _ => false,
    }
}

/// Index just past the bracket group opening at `open` (`(`, `[` or `{`).
fn close_of(t: &[Tok], open: usize) -> usize {
    let mut depth = 0i32;
    let mut i = open;
    while i < t.len() {
        match t[i] {
            Tok::Sym('(' | '[' | '{') => depth += 1,
            Tok::Sym(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    t.len()
}

/// Index just past the item starting at `i` (after its attributes): its `;`, or its `{..}`
/// body, whichever comes first outside brackets.
fn item_end(t: &[Tok], mut i: usize) -> usize {
    while i + 1 < t.len() && t[i] == Tok::Sym('#') && t[i + 1] == Tok::Sym('[') {
        i = close_of(t, i + 1);
    }
    while i < t.len() {
        match t[i] {
            Tok::Sym(';') => return i + 1,
            Tok::Sym('{') => return close_of(t, i),
            Tok::Sym('(' | '[') => i = close_of(t, i),
            _ => i += 1,
        }
    }
    t.len()
}

/// Drops every item under a test-only `#[cfg(..)]` (unit-test modules, test helpers).
pub(crate) fn without_tests(t: Vec<Tok>) -> Vec<Tok> {
    let mut out = Vec::with_capacity(t.len());
    let mut i = 0;
    while i < t.len() {
        let is_cfg = i + 4 < t.len()
            && t[i] == Tok::Sym('#')
            && t[i + 1] == Tok::Sym('[')
            && t[i + 2] == Tok::Ident("cfg".into())
            && t[i + 3] == Tok::Sym('(');
        if is_cfg {
            let pred_end = close_of(&t, i + 3);
            let attr_end = close_of(&t, i + 1);
            if test_only(&t[i + 4..pred_end - 1]) {
                i = item_end(&t, attr_end);
                continue;
            }
        }
        out.push(t[i].clone());
        i += 1;
    }
    out
}

/// One name brought in by a `use` declaration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UseItem {
    /// The path as written (`super::io::ConnIo`), `self` in a group folded away.
    pub(crate) path: Vec<String>,
    /// The name it is known by here (`as` renames it); `*` for a glob.
    pub(crate) alias: String,
    /// `pub use` / `pub(crate) use`: a re-export.
    pub(crate) public: bool,
}

/// What one file says about other modules.
#[derive(Debug, Default)]
pub(crate) struct FileRefs {
    /// Non-test `mod x;` declarations (submodule files).
    pub(crate) mods: Vec<String>,
    pub(crate) uses: Vec<UseItem>,
    /// Paths in code outside `use` declarations, each of two or more segments.
    pub(crate) paths: Vec<Vec<String>>,
    /// Every identifier in code outside `use` declarations (is a re-exported name used here?).
    pub(crate) words: std::collections::BTreeSet<String>,
}

fn use_tree(t: &[Tok], prefix: &[String], public: bool, out: &mut Vec<UseItem>) {
    // Split at top-level commas.
    let mut parts: Vec<&[Tok]> = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, tok) in t.iter().enumerate() {
        match tok {
            Tok::Sym('{') => depth += 1,
            Tok::Sym('}') => depth -= 1,
            Tok::Sym(',') if depth == 0 => {
                parts.push(&t[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&t[start..]);
    for part in parts {
        let mut path = prefix.to_vec();
        let mut i = 0;
        let mut alias = None;
        while i < part.len() {
            match &part[i] {
                Tok::Ident(w) if w == "as" => {
                    if let Some(Tok::Ident(a)) = part.get(i + 1) {
                        alias = Some(a.clone());
                    }
                    break;
                }
                Tok::Ident(w) => path.push(w.clone()),
                Tok::PathSep => {}
                Tok::Sym('{') => {
                    let end = close_of(part, i);
                    use_tree(&part[i + 1..end - 1], &path, public, out);
                    path.clear();
                    break;
                }
                Tok::Sym('*') => {
                    out.push(UseItem {
                        path: path.clone(),
                        alias: "*".into(),
                        public,
                    });
                    path.clear();
                    break;
                }
                _ => {}
            }
            i += 1;
        }
        if path.len() > prefix.len() || (alias.is_some() && !path.is_empty()) {
            if path.last().map(String::as_str) == Some("self") {
                path.pop();
            }
            let Some(last) = path.last().cloned() else {
                continue;
            };
            out.push(UseItem {
                alias: alias.unwrap_or(last),
                path,
                public,
            });
        }
    }
}

/// Reads one file's module references (test-only items excluded).
pub(crate) fn file_refs(src: &str) -> FileRefs {
    let t = without_tests(tokens(&strip(src)));
    let mut refs = FileRefs::default();
    let mut i = 0;
    let is = |i: usize, w: &str| matches!(t.get(i), Some(Tok::Ident(x)) if x == w);
    while i < t.len() {
        if is(i, "mod") {
            if let (Some(Tok::Ident(name)), Some(Tok::Sym(';'))) = (t.get(i + 1), t.get(i + 2)) {
                refs.mods.push(name.clone());
                i += 3;
                continue;
            }
        }
        if is(i, "use") && !matches!(t.get(i.wrapping_sub(1)), Some(Tok::PathSep)) {
            // `pub use`, `pub(crate) use`, `pub(super) use`, `pub(in a::b) use`.
            let public = (i >= 1 && is(i - 1, "pub")) || (i >= 2 && t[i - 1] == Tok::Sym(')'));
            let mut end = i + 1;
            while end < t.len() && t[end] != Tok::Sym(';') {
                end += 1;
            }
            use_tree(&t[i + 1..end], &[], public, &mut refs.uses);
            i = end + 1;
            continue;
        }
        if let Tok::Ident(w) = &t[i] {
            refs.words.insert(w.clone());
            let starts = !matches!(t.get(i.wrapping_sub(1)), Some(Tok::PathSep));
            if starts && t.get(i + 1) == Some(&Tok::PathSep) {
                let mut path = vec![w.clone()];
                let mut j = i + 1;
                while t.get(j) == Some(&Tok::PathSep) {
                    match t.get(j + 1) {
                        Some(Tok::Ident(x)) => {
                            path.push(x.clone());
                            refs.words.insert(x.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                refs.paths.push(path);
                i = j;
                continue;
            }
        }
        i += 1;
    }
    refs
}
