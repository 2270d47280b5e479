//! docs/ARCHITECTURE.md's map of crates and modules, compared with the tree so that it cannot
//! drift: the doc names every module a crate has, and no module that is gone.
//!
//! A list sits between `<!-- modules:DIR -->` (or `<!-- modules:DIR MODULE -->` for the children
//! of one module) and `<!-- /modules -->`, one item per module that starts with its name:
//! ``- `name`: what it holds``. DIR is a source directory relative to the repository root. Its
//! modules are read as modgraph reads them, from `lib.rs`; a crate with only a `main.rs` (the BPF
//! programs, xtask) is read from that file's `mod name;` lines.

// Only the tests call in here, as for modgraph, until a task does.
#![cfg_attr(not(test), expect(dead_code))]

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Result, bail, ensure};

use crate::modgraph;

/// One delimited list: its marker's `DIR` or `DIR MODULE`, the marker's line (from 1), and the
/// modules its items name.
struct List {
    key: String,
    line: usize,
    names: Vec<String>,
}

fn lists(doc: &str) -> Result<Vec<List>> {
    let (mut out, mut open) = (Vec::<List>::new(), false);
    for (n, line) in (1..).zip(doc.lines().map(str::trim)) {
        if let Some(spec) = line.strip_prefix("<!-- modules:") {
            ensure!(!open, "line {n}: a list opens inside another");
            let key = spec.trim_end_matches("-->").trim().to_string();
            let names = Vec::new();
            out.push(List {
                key,
                line: n,
                names,
            });
            open = true;
        } else if line == "<!-- /modules -->" {
            ensure!(open, "line {n}: `<!-- /modules -->` closes no list");
            open = false;
        } else if let Some(item) = line.strip_prefix("- `").filter(|_| open) {
            let name = item.split('`').next().unwrap_or_default().to_string();
            out.last_mut().expect("a list is open").names.push(name);
        }
    }
    match out.last() {
        Some(list) if open => bail!("line {}: the list is never closed", list.line),
        _ => Ok(out),
    }
}

/// The modules the tree has for a list's key.
fn tree_modules(root: &Path, key: &str) -> Result<Vec<String>> {
    let (dir, module) = key.split_once(' ').unwrap_or((key, ""));
    let src = root.join(dir);
    if src.join("lib.rs").is_file() {
        // An empty module is the crate root: its children are the top-level modules.
        modgraph::child_modules(&src, module)
    } else if module.is_empty() {
        modgraph::declared_modules(&src.join("main.rs"))
    } else {
        bail!("{dir} has no lib.rs to read the children of {module} from")
    }
}

/// Compares every list in `doc` with the tree under `root`. Returns the keys of the lists found,
/// or one message per list that differs, naming the modules the doc lacks and the ones it names
/// that the tree no longer has.
pub fn check(root: &Path, doc: &str) -> Result<Vec<String>, Vec<String>> {
    let lists = lists(doc).map_err(|e| vec![format!("{e:#}")])?;
    let mut problems = Vec::new();
    for list in &lists {
        let at = format!("line {}, the modules of {}", list.line, list.key);
        let tree: BTreeSet<String> = match tree_modules(root, &list.key) {
            Ok(tree) => tree.into_iter().collect(),
            Err(e) => {
                problems.push(format!("{at}: {e:#}"));
                continue;
            }
        };
        let named: BTreeSet<String> = list.names.iter().cloned().collect();
        let minus = |a: &BTreeSet<String>, b| a.difference(b).cloned().collect::<Vec<_>>();
        let mut msg = Vec::new();
        for (what, names) in [
            ("missing from the doc", minus(&tree, &named)),
            ("no longer in the tree", minus(&named, &tree)),
        ] {
            if !names.is_empty() {
                msg.push(format!("{what}: {}", names.join(", ")));
            }
        }
        if named.len() < list.names.len() {
            msg.push("a module is named twice".to_string());
        }
        if !msg.is_empty() {
            problems.push(format!("{at}: {}", msg.join("; ")));
        }
    }
    let keys = lists.into_iter().map(|l| l.key).collect();
    problems.is_empty().then_some(keys).ok_or(problems)
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::modgraph::tests::Scratch;

    /// Every list the map keeps, so that dropping one is no way to pass.
    const LISTS: [&str; 7] = [
        "ebpf/sidestep-ebpf/src",
        "userspace/src",
        "userspace/daemon/src",
        "userspace/daemon/src agent",
        "cni/src",
        "xtask/src",
        "tests/src",
    ];

    fn root() -> &'static Path {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
    }

    fn architecture() -> String {
        fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap()
    }

    #[test]
    fn architecture_lists_every_module() {
        let found = check(root(), &architecture())
            .unwrap_or_else(|p| panic!("docs/ARCHITECTURE.md:\n{}", p.join("\n")));
        let lacking = LISTS.iter().filter(|l| !found.iter().any(|f| f == *l));
        let lacking: Vec<_> = lacking.collect();
        assert!(lacking.is_empty(), "no list for {lacking:?}");
    }

    /// Every crate of the workspace, members and excluded, has a ``### `path` `` heading in the
    /// map, and every such heading is a crate.
    #[test]
    fn architecture_lists_every_crate() {
        let manifest = fs::read_to_string(root().join("Cargo.toml")).unwrap();
        let mut crates = BTreeSet::new();
        for key in ["members", "exclude"] {
            // One line, `members = ["a", "b"]`: its quoted strings.
            let line = manifest.lines().find(|l| l.starts_with(key)).unwrap();
            crates.extend(line.split('"').skip(1).step_by(2));
        }
        let doc = architecture();
        fn heading(line: &str) -> Option<&str> {
            line.strip_prefix("### `")?.strip_suffix('`')
        }
        let headings: BTreeSet<&str> = doc.lines().filter_map(heading).collect();
        let missing: Vec<_> = crates.difference(&headings).collect();
        assert!(missing.is_empty(), "no heading for {missing:?}");
        for h in headings {
            let is_crate = root().join(h).join("Cargo.toml").is_file();
            assert!(is_crate, "### `{h}`: no crate");
        }
    }

    /// Every `](#anchor)` link in the doc leads to one of its headings, so that "Read this first"
    /// keeps working when a heading is reworded.
    #[test]
    fn architecture_links_resolve() {
        let doc = architecture();
        let slug = |h: &str| -> String {
            let h = h.trim_start_matches('#').trim().to_lowercase();
            let keep = |c: &char| c.is_alphanumeric() || "- _".contains(*c);
            let dash = |c| if c == ' ' { '-' } else { c };
            h.chars().filter(keep).map(dash).collect()
        };
        let headings = doc.lines().filter(|l| l.starts_with('#'));
        let anchors: BTreeSet<String> = headings.map(slug).collect();
        let links = doc.split("](#").skip(1).filter_map(|l| l.split_once(')'));
        let broken: Vec<_> = links.filter(|l| !anchors.contains(l.0)).collect();
        assert!(broken.is_empty(), "links to no heading: {broken:?}");
    }

    /// A library crate with a child module, and a binary crate; `DOC` lists them in full.
    fn tree(name: &str) -> Scratch {
        let files = "
== lib/src/lib.rs
pub mod a; mod b; #[cfg(test)] mod tests;
== lib/src/a.rs
mod x; mod y;
== lib/src/a/x.rs
== lib/src/a/y.rs
== lib/src/b.rs
== lib/src/tests.rs
== bin/src/main.rs
mod p; mod q;
";
        Scratch::new(name, files)
    }

    const DOC: &str = "
<!-- modules:lib/src -->
- `a`: holds x and y,
  on two lines.
- `b`: the other.
<!-- /modules -->
<!-- modules:lib/src a -->
- `x`: one
- `y`: two
<!-- /modules -->
<!-- modules:bin/src -->
- `p`: three
- `q`: four
<!-- /modules -->
";

    #[test]
    fn names_a_module_missing_from_the_doc() {
        let s = tree("archdoc-missing");
        let keys = ["lib/src", "lib/src a", "bin/src"];
        assert_eq!(check(&s.0, DOC).unwrap(), keys);
        let doc = DOC.replace("- `b`: the other.\n", "");
        let doc = doc.replace("- `q`: four\n", "");
        assert_eq!(
            check(&s.0, &doc).unwrap_err(),
            [
                "line 2, the modules of lib/src: missing from the doc: b",
                "line 10, the modules of bin/src: missing from the doc: q",
            ]
        );
    }

    #[test]
    fn names_a_stale_module() {
        let s = tree("archdoc-stale");
        // y is renamed to z in the tree, and p removed; the doc still names both.
        fs::rename(s.0.join("lib/src/a/y.rs"), s.0.join("lib/src/a/z.rs")).unwrap();
        fs::write(s.0.join("lib/src/a.rs"), "mod x; mod z;").unwrap();
        fs::write(s.0.join("bin/src/main.rs"), "mod q;").unwrap();
        assert_eq!(
            check(&s.0, DOC).unwrap_err(),
            [
                "line 7, the modules of lib/src a: missing from the doc: z; \
                 no longer in the tree: y",
                "line 11, the modules of bin/src: no longer in the tree: p",
            ]
        );
    }
}
