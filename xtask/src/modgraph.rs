//! The library's module graph, read from `userspace/src` without building it. Issue 37 broke one
//! knot of 18 mutually dependent modules apart (docs/research/issue-37-plan.md §5); `check` keeps
//! new circles out, among the top-level modules and among the siblings of any one directory. The
//! same walk lists the modules for ARCHITECTURE.md's check.
//!
//! An edge is a `crate::`, `super::` or `self::` path in non-test code, `use` groups included,
//! resolved to the longest module path that exists. Bare paths to a child (`use facts::Route`)
//! only ever link a parent and its child, which neither check counts, so they are not read.

// Only the tests call in here until a task and ARCHITECTURE.md's check do.
#![cfg_attr(not(test), expect(dead_code))]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// A module path below the crate root; empty is the root itself.
type ModPath = Vec<String>;

struct Module {
    path: ModPath,
    file: PathBuf,
}

/// One path that makes `from` use `to`, and where (`file:line`, relative to the source root).
struct Edge {
    from: ModPath,
    to: ModPath,
    at: String,
}

struct Tree {
    /// Sorted by path, so that the first example of an edge is the same on every run.
    modules: Vec<Module>,
    edges: Vec<Edge>,
}

/// Fails with one message per cycle among the top-level modules or among the children of one
/// module, each edge with a line that makes it, so a developer knows what to move.
pub fn check(src_root: &Path) -> Result<(), Vec<String>> {
    let tree = read_tree(src_root).map_err(|e| vec![format!("{e:#}")])?;
    let mut problems = Vec::new();
    // The root's children are the top-level modules, so one loop makes both checks.
    for parent in tree.modules.iter().map(|m| &m.path) {
        let n = parent.len();
        let mut graph = BTreeMap::new();
        for e in &tree.edges {
            // Strict descendants only: a child using its parent (or the reverse) is not a circle
            // that moving code between siblings could break.
            let inside = |p: &ModPath| p.len() > n && p.starts_with(parent);
            if inside(&e.from) && inside(&e.to) && e.from[n] != e.to[n] {
                let key = (e.from[..=n].join("::"), e.to[..=n].join("::"));
                graph.entry(key).or_insert_with(|| e.at.clone());
            }
        }
        let scope = match n {
            0 => "the top-level modules".to_string(),
            _ => format!("the children of {}", parent.join("::")),
        };
        for cycle in cycles(&graph) {
            let mut msg = format!("cycle among {scope}: {}", cycle.join(" -> "));
            for pair in cycle.windows(2) {
                let at = &graph[&(pair[0].clone(), pair[1].clone())];
                msg.push_str(&format!("\n    {} -> {}: {at}", pair[0], pair[1]));
            }
            problems.push(msg);
        }
    }
    problems.is_empty().then_some(()).ok_or(problems)
}

/// The library's top-level modules, private ones included, sorted.
pub fn top_level_modules(src_root: &Path) -> Result<Vec<String>> {
    child_modules(src_root, "")
}

/// The names of the children of `module` (`enroll`, `netns::addresses`), sorted; test modules
/// are not counted.
pub fn child_modules(src_root: &Path, module: &str) -> Result<Vec<String>> {
    let tree = read_tree(src_root)?;
    let parent: ModPath = module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if !tree.modules.iter().any(|m| m.path == parent) {
        bail!("{} has no module {module}", src_root.display());
    }
    let n = parent.len();
    let children = tree
        .modules
        .iter()
        .filter(|m| m.path.len() == n + 1 && m.path.starts_with(&parent));
    Ok(children.map(|m| m.path[n].clone()).collect())
}

/// The modules that one root file (a binary's `main.rs`) declares with `mod name;`, sorted; test
/// modules are not counted. For crates without a `lib.rs`, which the walk above starts from.
pub fn declared_modules(file: &Path) -> Result<Vec<String>> {
    let text = fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let parsed = parse(&tokens(&strip(&text)));
    let names = parsed.children.into_iter().map(|(name, _)| name);
    let mut names: Vec<String> = names.filter(|name| name != "tests").collect();
    names.sort();
    Ok(names)
}

/// One shortest cycle through each node that is on one, each listed once, from its smallest
/// node back to it. Not every cycle of a knot: fixing these shows the next ones.
fn cycles(graph: &BTreeMap<(String, String), String>) -> BTreeSet<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in graph.keys() {
        next.entry(a).or_default().push(b);
    }
    let mut found = BTreeSet::new();
    for &start in next.keys() {
        let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = VecDeque::from([start]);
        'bfs: while let Some(node) = queue.pop_front() {
            for &to in next.get(node).into_iter().flatten() {
                if to == start {
                    let mut cycle = vec![node];
                    while let Some(&p) = prev.get(cycle[cycle.len() - 1]) {
                        cycle.push(p);
                    }
                    cycle.reverse();
                    let first = (0..cycle.len()).min_by_key(|&i| cycle[i]).unwrap_or(0);
                    cycle.rotate_left(first);
                    cycle.push(cycle[0]);
                    found.insert(cycle.into_iter().map(String::from).collect());
                    break 'bfs;
                }
                if !prev.contains_key(to) {
                    prev.insert(to, node);
                    queue.push_back(to);
                }
            }
        }
    }
    found
}

fn read_tree(src_root: &Path) -> Result<Tree> {
    let rel = |f: &Path| f.strip_prefix(src_root).unwrap_or(f).display().to_string();
    let mut files = Vec::new();
    let mut queue = vec![(ModPath::new(), src_root.join("lib.rs"))];
    while let Some((path, file)) = queue.pop() {
        let text =
            fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        let parsed = parse(&tokens(&strip(&text)));
        // lib.rs and mod.rs hold their children beside them; x.rs holds them in x/.
        let dir = if path.is_empty() || file.ends_with("mod.rs") {
            file.parent().unwrap_or(src_root).to_owned()
        } else {
            file.with_extension("")
        };
        for (name, line) in &parsed.children {
            if name == "tests" {
                continue;
            }
            let flat = dir.join(format!("{name}.rs"));
            let nested = dir.join(name).join("mod.rs");
            let child = match (flat.is_file(), nested.is_file()) {
                (true, _) => flat,
                (false, true) => nested,
                (false, false) => bail!("{}:{line}: no file for `mod {name}`", rel(&file)),
            };
            let mut child_path = path.clone();
            child_path.push(name.clone());
            queue.push((child_path, child));
        }
        files.push((Module { path, file }, parsed.paths));
    }
    files.sort_by(|a, b| a.0.path.cmp(&b.0.path));
    let known: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.path.clone()).collect();
    let mut edges = Vec::new();
    for (module, paths) in &files {
        for (segments, line) in paths {
            if let Some(to) = resolve(&module.path, segments, &known) {
                let (from, at) = (module.path.clone(), format!("{}:{line}", rel(&module.file)));
                edges.push(Edge { from, to, at });
            }
        }
    }
    let modules = files.into_iter().map(|(m, _)| m).collect();
    Ok(Tree { modules, edges })
}

/// The longest existing module that `segments`, written in `from`, names.
fn resolve(from: &ModPath, segments: &[String], known: &BTreeSet<ModPath>) -> Option<ModPath> {
    let mut base = from.clone();
    let mut rest = segments;
    match rest.first().map(String::as_str) {
        Some("crate") => base.clear(),
        Some("self" | "super") => {}
        _ => return None,
    }
    if rest[0] != "super" {
        rest = &rest[1..];
    }
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    for segment in rest {
        base.push(segment.clone());
        if !known.contains(&base) {
            base.pop();
            break;
        }
    }
    Some(base)
}

/// Blanks comments and string and char literals, keeping newlines so line numbers hold: doc
/// links and messages that mention `crate::x` make no edge, and a `'{'` no brace.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < c.len() {
        let end = literal_end(&c, i);
        if end == i {
            out.push(c[i]);
            i += 1;
        } else {
            let blank = |&ch: &char| if ch == '\n' { '\n' } else { ' ' };
            out.extend(c[i..end].iter().map(blank));
            i = end;
        }
    }
    out
}

/// Where a comment or literal that starts at `i` ends, or `i` if none starts there.
fn literal_end(c: &[char], i: usize) -> usize {
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let ident = |k: Option<usize>| k.is_some_and(|k| at(k).is_alphanumeric() || at(k) == '_');
    let find = |from: usize, pat: &dyn Fn(usize) -> bool| (from..c.len()).find(|&k| pat(k));
    match (c[i], at(i + 1)) {
        ('/', '/') => find(i, &|k| c[k] == '\n').unwrap_or(c.len()),
        ('/', '*') => {
            // Block comments nest in Rust.
            let (mut depth, mut k) = (0, i);
            while k < c.len() {
                match (c[k], at(k + 1)) {
                    ('/', '*') => (depth, k) = (depth + 1, k + 2),
                    ('*', '/') if depth == 1 => return k + 2,
                    ('*', '/') => (depth, k) = (depth - 1, k + 2),
                    _ => k += 1,
                }
            }
            c.len()
        }
        ('"', _) => {
            let mut k = i + 1;
            while k < c.len() && c[k] != '"' {
                k += if c[k] == '\\' { 2 } else { 1 };
            }
            (k + 1).min(c.len())
        }
        // r"…", r#"…"#, br"…", but not an identifier ending in r, nor r#ident.
        ('r', '"' | '#')
            if !ident(i.checked_sub(1)) || (at(i - 1) == 'b' && !ident(i.checked_sub(2))) =>
        {
            let hashes = (i + 1..c.len()).take_while(|&k| c[k] == '#').count();
            if at(i + 1 + hashes) != '"' {
                return i;
            }
            let closes = |k: usize| c[k] == '"' && (1..=hashes).all(|h| at(k + h) == '#');
            find(i + 2 + hashes, &closes).map_or(c.len(), |k| k + 1 + hashes)
        }
        ('\'', '\\') => find(i + 3, &|k| c[k] == '\'').map_or(c.len(), |k| k + 1),
        ('\'', _) if at(i + 2) == '\'' => i + 3,
        // Otherwise a lifetime or label.
        _ => i,
    }
}

struct Token {
    text: String,
    line: usize,
}

fn tokens(src: &str) -> Vec<Token> {
    let mut out: Vec<Token> = Vec::new();
    let word = |ch: char| ch.is_alphanumeric() || ch == '_';
    for (n, line) in src.lines().enumerate() {
        let mut prev = ' ';
        for ch in line.chars() {
            match out.last_mut() {
                Some(t) if word(ch) && word(prev) => t.text.push(ch),
                Some(t) if ch == ':' && prev == ':' && t.text == ":" => t.text.push(ch),
                _ if ch.is_whitespace() => {}
                _ => out.push(Token {
                    text: ch.to_string(),
                    line: n + 1,
                }),
            }
            prev = ch;
        }
    }
    out
}

type Leaves = Vec<(Vec<String>, usize)>;

#[derive(Default)]
struct Parsed {
    /// `mod name;` declarations, with their lines.
    children: Vec<(String, usize)>,
    /// Every `crate`/`super`/`self` path, one per leaf of a `use` group, with the leaf's line
    /// (a long group spans lines, and the leaf is what a developer would move).
    paths: Leaves,
}

fn parse(t: &[Token]) -> Parsed {
    let text = |i: usize| t.get(i).map_or("", |t| t.text.as_str());
    let mut parsed = Parsed::default();
    let mut i = 0;
    while i < t.len() {
        let cfg_test = ["#", "[", "cfg", "(", "test", ")", "]"];
        if cfg_test.iter().enumerate().all(|(k, s)| text(i + k) == *s) {
            i = skip_item(t, i + cfg_test.len());
        } else if text(i) == "mod" && text(i + 2) == ";" {
            parsed.children.push((text(i + 1).to_string(), t[i].line));
            i += 3;
        } else if matches!(text(i), "crate" | "super" | "self")
            && text(i + 1) == "::"
            && text(i.wrapping_sub(1)) != "::"
        {
            i = path_tree(t, i, &[], &mut parsed.paths);
        } else {
            i += 1;
        }
    }
    parsed
}

/// Past the item that starts at `i` (after its `#[cfg(test)]`): further attributes, then up to
/// a `;` outside brackets or the `}` that closes its body.
fn skip_item(t: &[Token], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < t.len() {
        match t[i].text.as_str() {
            "(" | "[" | "{" => depth += 1,
            ")" | "]" => depth = depth.saturating_sub(1),
            "}" => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            ";" if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Expands the path at `i` under `prefix`, `{…}` groups nested to any depth, into one path per
/// leaf (a group's `self` is its prefix, a glob names its prefix); returns where it ends.
fn path_tree(t: &[Token], mut i: usize, prefix: &[String], out: &mut Leaves) -> usize {
    let text = |i: usize| t.get(i).map_or("", |t| t.text.as_str());
    let mut path = prefix.to_vec();
    loop {
        match text(i) {
            "{" => {
                i += 1;
                while i < t.len() && text(i) != "}" {
                    let word = text(i).starts_with(|c: char| c.is_alphanumeric() || c == '_');
                    i = if word || text(i) == "{" {
                        path_tree(t, i, &path, out)
                    } else {
                        i + 1
                    };
                }
                return i + 1;
            }
            "*" => {
                out.push((path, t[i].line));
                return i + 1;
            }
            "self" if !path.is_empty() => {}
            segment => path.push(segment.to_string()),
        }
        if text(i + 1) == "::" && text(i + 2) != "<" {
            i += 2;
            continue;
        }
        out.push((path, t[i].line));
        return if text(i + 1) == "as" { i + 3 } else { i + 1 };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A source tree under the system's temp dir, removed when dropped (xtask has no tempfile).
    /// `files` is one string so that rustfmt keeps it short: `== path` starts each file. The
    /// archdoc tests build their trees with it too.
    pub(crate) struct Scratch(pub(crate) PathBuf);

    impl Scratch {
        pub(crate) fn new(name: &str, files: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("modgraph-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            for file in files.split("== ").skip(1) {
                let (path, text) = file.split_once('\n').unwrap();
                let path = dir.join(path.trim());
                fs::create_dir_all(path.parent().unwrap()).unwrap();
                fs::write(path, text).unwrap();
            }
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// The modules that `from` uses, sorted, space-separated.
    fn uses(src: &Path, from: &str) -> String {
        let of = |p: &ModPath| p.join("::");
        let tree = read_tree(src).unwrap();
        let to: BTreeSet<_> = tree
            .edges
            .iter()
            .filter(|e| of(&e.from) == from)
            .map(|e| of(&e.to))
            .collect();
        to.into_iter().collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn finds_a_top_level_cycle() {
        let s = Scratch::new(
            "top",
            "
== lib.rs
pub mod a; pub mod b; mod c;
== a.rs
pub mod inner;
== a/inner.rs
use crate::c;

use crate::b::X;
== b.rs
pub fn f() {
    crate::a::inner::g();
}
== c.rs
",
        );
        let cycle = "cycle among the top-level modules: a -> b -> a\n    \
                     a -> b: a/inner.rs:3\n    b -> a: b.rs:2";
        assert_eq!(check(&s.0).unwrap_err(), [cycle]);
    }

    #[test]
    fn finds_a_cycle_among_siblings() {
        // Only p's children x and y make a circle: p uses x, and z is y's child.
        let s = Scratch::new(
            "siblings",
            "
== lib.rs
pub mod p;
== p/mod.rs
mod x; mod y; use self::x::A;
== p/x.rs
use super::y::B;
== p/y.rs
mod z;
== p/y/z.rs
fn f() { super::super::x::g(); super::super::A }
",
        );
        let cycle = "cycle among the children of p: p::x -> p::y -> p::x\n    \
                     p::x -> p::y: p/x.rs:1\n    p::y -> p::x: p/y/z.rs:1";
        assert_eq!(check(&s.0).unwrap_err(), [cycle]);
    }

    #[test]
    fn groups_super_and_self_resolve() {
        let s = Scratch::new(
            "resolve",
            r##"
== lib.rs
mod a; mod d; mod e;
== a.rs
pub mod b; pub mod c; use self::b::Y; use crate::a::{self, c::Z as W};
== a/b.rs
use super::{c::*, super::d};
== a/c.rs
fn f<'a>(x: &'a str) -> char { crate::d::g::<u8>(); '{' }
== d.rs
/// [`crate::e`]
const S: &str = "crate::e"; const R: &str = r#"crate::e"#; /* crate::e */
== e.rs
use crate::{a::{b, c}, d};
"##,
        );
        assert_eq!(uses(&s.0, "e"), "a::b a::c d");
        assert_eq!(uses(&s.0, "a"), "a a::b a::c");
        assert_eq!(uses(&s.0, "a::b"), "a::c d");
        assert_eq!(uses(&s.0, "a::c"), "d");
        assert_eq!(uses(&s.0, "d"), "");
    }

    #[test]
    fn test_code_is_ignored() {
        let s = Scratch::new(
            "tests",
            "
== lib.rs
mod a; mod b; #[cfg(test)] mod tests;
== tests.rs
use crate::a::X;
== a.rs
use crate::b::X;
#[cfg(test)]
mod tests { use crate::a::Y; }
== b.rs
#[cfg(test)] #[allow(unused)] mod tests;
#[cfg(test)] fn f() { crate::a::g() }
== b/tests.rs
use crate::a::X;
",
        );
        assert_eq!(check(&s.0), Ok(()));
        assert_eq!(uses(&s.0, "b"), "");
        assert_eq!(top_level_modules(&s.0).unwrap(), ["a", "b"]);
    }

    #[test]
    fn lists_modules() {
        let s = Scratch::new(
            "list",
            "
== lib.rs
pub mod net; mod sys;
== net/mod.rs
pub(crate) mod link; mod addr;
== net/addr.rs
== net/link.rs
mod pin;
== net/link/pin.rs
== sys.rs
",
        );
        assert_eq!(top_level_modules(&s.0).unwrap(), ["net", "sys"]);
        assert_eq!(child_modules(&s.0, "net").unwrap(), ["addr", "link"]);
        assert_eq!(child_modules(&s.0, "net::link").unwrap(), ["pin"]);
        assert!(child_modules(&s.0, "nope").is_err());
    }

    #[test]
    fn lists_declared_modules() {
        let s = Scratch::new(
            "declared",
            "
== main.rs
mod b; pub(crate) mod a; #[cfg(test)] mod tests; #[cfg(test)] mod fixtures;
// mod commented;
mod inline { }
",
        );
        assert_eq!(declared_modules(&s.0.join("main.rs")).unwrap(), ["a", "b"]);
        assert!(declared_modules(&s.0.join("nope.rs")).is_err());
    }

    #[test]
    fn library_has_no_import_cycles() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../userspace/src");
        if let Err(problems) = check(&src) {
            panic!("{}", problems.join("\n"));
        }
    }

    #[test]
    fn daemon_has_no_import_cycles() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../userspace/daemon/src");
        if let Err(problems) = check(&src) {
            panic!("{}", problems.join("\n"));
        }
    }
}
