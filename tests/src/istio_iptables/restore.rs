//! The rule list in istio's builder form and its `iptables-restore` text
//! (`tools/istio-iptables/pkg/builder/iptables_builder_impl.go`). Separate from the rule
//! builder because the `-N` lines and table order are a property of the output format, not of
//! any one rule.

use std::collections::HashSet;
use std::fmt::Write as _;

/// Chains and targets that are never created with `-N`.
const BUILTIN: [&str; 8] = [
    "INPUT",
    "OUTPUT",
    "FORWARD",
    "PREROUTING",
    "POSTROUTING",
    "ACCEPT",
    "RETURN",
    "DROP",
];

pub(super) struct Rule {
    pub(super) table: &'static str,
    pub(super) chain: String,
    pub(super) insert_at: Option<u32>,
    pub(super) args: Vec<String>,
}

#[derive(Default)]
pub(super) struct Rules(pub(super) Vec<Rule>);

impl Rules {
    pub(super) fn add(&mut self, table: &'static str, chain: &str, args: String) {
        self.push(table, chain, None, args);
    }

    pub(super) fn insert(&mut self, table: &'static str, chain: &str, pos: u32, args: String) {
        self.push(table, chain, Some(pos), args);
    }

    fn push(&mut self, table: &'static str, chain: &str, insert_at: Option<u32>, args: String) {
        let args = args.split_whitespace().map(String::from).collect();
        self.0.push(Rule {
            table,
            chain: chain.to_string(),
            insert_at,
            args,
        });
    }
}

/// Turns the rule list into restore input. Tables come in name order, each with its `-N` lines
/// first. The `-N` lines follow the order in which chains first appear: as a rule's chain, then
/// as a jump target at the end of a rule. Then come the rules as `-A CHAIN ...` or
/// `-I CHAIN pos ...`, then COMMIT.
pub(super) fn render(rules: &[Rule]) -> String {
    let mut tables: Vec<&'static str> = rules.iter().map(|r| r.table).collect();
    tables.sort_unstable();
    tables.dedup();

    let mut created: HashSet<(&str, &str)> = HashSet::new();
    let mut new_chains: Vec<(&str, &str)> = Vec::new();
    let builtin = |c: &str| BUILTIN.contains(&c);
    for r in rules {
        if !builtin(&r.chain) && created.insert((r.table, r.chain.as_str())) {
            new_chains.push((r.table, r.chain.as_str()));
        }
    }
    for r in rules {
        if let [.., j, target] = r.args.as_slice()
            && j == "-j"
            && !builtin(target)
            && created.insert((r.table, target.as_str()))
        {
            new_chains.push((r.table, target.as_str()));
        }
    }

    let mut out = String::new();
    for table in tables {
        // istio writes the header as "* <table>" (with a space); iptables-restore accepts it.
        let _ = writeln!(out, "* {table}");
        for (_, chain) in new_chains.iter().filter(|(t, _)| *t == table) {
            let _ = writeln!(out, "-N {chain}");
        }
        for r in rules.iter().filter(|r| r.table == table) {
            match r.insert_at {
                Some(pos) => {
                    let _ = writeln!(out, "-I {} {} {}", r.chain, pos, r.args.join(" "));
                }
                None => {
                    let _ = writeln!(out, "-A {} {}", r.chain, r.args.join(" "));
                }
            }
        }
        out.push_str("COMMIT\n");
    }
    out
}
