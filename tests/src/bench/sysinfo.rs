//! The machine and tools the figures come from.

use std::fs;
use std::process::Command;

#[derive(Clone, Debug, Default)]
pub struct SysInfo {
    pub quick: bool,
    /// `date -u`.
    pub date: String,
    /// `uname -r`.
    pub kernel: String,
    /// The first `model name` of /proc/cpuinfo.
    pub cpu: String,
    /// `nproc`.
    pub nproc: String,
    /// /proc/loadavg.
    pub loadavg: String,
    /// First version line of each tool.
    pub tools: Vec<(String, String)>,
}

fn first_line(argv: &[&str]) -> String {
    let Some((prog, args)) = argv.split_first() else {
        return String::new();
    };
    match Command::new(prog).args(args).output() {
        Ok(o) => {
            let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
            s.push_str(&String::from_utf8_lossy(&o.stderr));
            s.lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("")
                .to_owned()
        }
        Err(e) => format!("unavailable ({e})"),
    }
}

impl SysInfo {
    pub fn collect(quick: bool) -> Self {
        let cpu = fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".into());
        let tools = [
            ("wrk", vec!["wrk", "--version"]),
            ("sockperf", vec!["sockperf", "--version"]),
            ("iperf3", vec!["iperf3", "--version"]),
            ("haproxy", vec!["haproxy", "-v"]),
            ("nginx", vec!["nginx", "-v"]),
            ("iptables", vec!["iptables-legacy-restore", "--version"]),
        ]
        .into_iter()
        .map(|(n, argv)| (n.to_owned(), first_line(&argv)))
        .collect();
        Self {
            quick,
            date: first_line(&["date", "-u"]),
            kernel: first_line(&["uname", "-r"]),
            cpu,
            nproc: first_line(&["nproc"]),
            loadavg: fs::read_to_string("/proc/loadavg")
                .map(|s| s.trim().to_owned())
                .unwrap_or_default(),
            tools,
        }
    }
}
