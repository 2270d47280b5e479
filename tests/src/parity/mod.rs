//! Machinery of the differential parity test (`tests/tests/parity.rs`): the observable outcome of
//! one connection, the probe listeners that report it, Istio's real ruleset applied to a pod
//! netns as the oracle, and the printed table.
//!
//! An outcome is what a proxy and an app can observe: which listener accepted the connection,
//! what `getsockname` and `SO_ORIGINAL_DST` (`SOL_IP` and `SOL_IPV6`) returned there, and what
//! `getpeername` returned to the connecting app (or how its connect failed). Addresses are
//! printed with symbolic names (`S4`, `P6`, ...) so that rows read the same on every run.

use std::collections::BTreeSet;
use std::fmt;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::env::TestEnv;
use crate::istio_iptables::IstioCapture;
use crate::net::wait_listening;
use crate::pod::Pod;
use crate::process::{ChildGuard, Spawn};

/// What one connection looked like from both of its ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The listener that accepted: `15001`, `15006`, `15053`, `S:8080` (an app port of the
    /// subject pod), `P:80` (the other pod), `node:18093`, or `none`.
    pub accepted: String,
    /// getsockname of the accepted socket (`-` when nothing accepted).
    pub local: String,
    /// SO_ORIGINAL_DST at SOL_IP: an address or an errno name.
    pub orig_v4: String,
    /// SO_ORIGINAL_DST at SOL_IPV6 (IP6T_SO_ORIGINAL_DST).
    pub orig_v6: String,
    /// getpeername of the app's socket, or `ERR <errno name>` when its connect failed.
    pub app_peer: String,
    /// The connection's source address: the app's getsockname, which the accepted socket's
    /// getpeername must equal (port included; it is elided then). `-` when nothing accepted.
    pub source: String,
}

impl Outcome {
    /// A connect that failed with `errno` and reached no listener.
    pub fn failed(errno: i64) -> Self {
        Self {
            accepted: "none".into(),
            local: "-".into(),
            orig_v4: "-".into(),
            orig_v6: "-".into(),
            app_peer: format!("ERR {}", errno_name(errno)),
            source: "-".into(),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.accepted == "none" {
            return write!(f, "none {}", self.app_peer);
        }
        write!(
            f,
            "{} sn={} od4={} od6={} pn={} src={}",
            self.accepted, self.local, self.orig_v4, self.orig_v6, self.app_peer, self.source
        )
    }
}

/// Names for the errnos the probes report.
pub fn errno_name(errno: i64) -> String {
    let name = match errno {
        2 => "ENOENT",
        22 => "EINVAL",
        92 => "ENOPROTOOPT",
        95 => "EOPNOTSUPP",
        99 => "EADDRNOTAVAIL",
        101 => "ENETUNREACH",
        110 => "ETIMEDOUT",
        111 => "ECONNREFUSED",
        113 => "EHOSTUNREACH",
        _ => return format!("errno{errno}"),
    };
    name.into()
}

/// Symbolic names for the topology's addresses.
#[derive(Clone, Debug, Default)]
pub struct Names(Vec<(IpAddr, String)>);

impl Names {
    pub fn add(&mut self, ip: IpAddr, name: &str) {
        self.0.push((ip, name.to_owned()));
    }

    /// `ip` by name: `S4`, `[S6]`-style brackets are added by [`Self::addr`]. IPv4-mapped
    /// addresses keep their prefix (`::ffff:P4`).
    pub fn ip(&self, ip: IpAddr) -> String {
        let lookup = |ip: IpAddr| {
            self.0
                .iter()
                .find(|(a, _)| *a == ip)
                .map(|(_, n)| n.clone())
        };
        if let Some(n) = lookup(ip) {
            return n;
        }
        if let IpAddr::V6(v6) = ip
            && let Some(v4) = v6.to_ipv4_mapped()
        {
            return format!(
                "::ffff:{}",
                lookup(IpAddr::V4(v4)).unwrap_or(v4.to_string())
            );
        }
        ip.to_string()
    }

    /// `addr` with the IP by name: `S4:8080`, `[S6]:8080`, `[::ffff:P4]:80`, `127.0.0.1:15001`;
    /// an IPv6 scope id is kept (`[S6ll%2]:8080`): without it a link-local address cannot be
    /// connected to.
    pub fn addr(&self, addr: SocketAddr) -> String {
        match addr {
            SocketAddr::V4(a) => format!("{}:{}", self.ip(IpAddr::V4(*a.ip())), a.port()),
            SocketAddr::V6(a) if a.scope_id() != 0 => format!(
                "[{}%{}]:{}",
                self.ip(IpAddr::V6(*a.ip())),
                a.scope_id(),
                a.port()
            ),
            SocketAddr::V6(a) => format!("[{}]:{}", self.ip(IpAddr::V6(*a.ip())), a.port()),
        }
    }

    /// An address as a probe printed it, by name; anything else unchanged.
    pub fn text(&self, s: &str) -> String {
        s.parse::<SocketAddr>()
            .map(|a| self.addr(a))
            .unwrap_or_else(|_| s.to_owned())
    }

    /// A probe's `{"addr":..}` / `{"errno":..}` SO_ORIGINAL_DST result, by name.
    fn orig(&self, v: &Value) -> String {
        if let Some(a) = v["addr"].as_str() {
            return self.text(a);
        }
        v["errno"]
            .as_i64()
            .map(errno_name)
            .unwrap_or_else(|| format!("?{v}"))
    }
}

/// One `probe proxy ... - --no-forward --v6only` process: every address it listens on reports
/// each accepted connection as a JSON line on stdout.
struct Group {
    id: usize,
    guard: ChildGuard,
    /// Label of a listener from its port: `15001`, `S:8080`, ...
    label: fn(u16) -> String,
    seen: usize,
}

/// ztunnel's in-pod socket mark (Istio's InpodMark, 0x539).
const ZTUNNEL_MARK: u32 = 0x539;

/// The probe listeners of a topology. Each connection is attributed to the listener whose
/// probe printed a new line.
#[derive(Default)]
pub struct Listeners {
    groups: Vec<Group>,
    started: usize,
    /// SO_MARK for the next group's binds (`start_ztunnel`).
    bind_mark: Option<u32>,
}

/// A listener process of [`Listeners`], to stop it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupId(usize);

/// A connection a listener reported.
#[derive(Debug)]
pub struct Accepted {
    pub listener: String,
    pub line: Value,
}

impl Listeners {
    /// Starts a listener process on `addrs` in `pod` (None: the node's root netns) as `uid`/`gid`,
    /// and waits until every address listens.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        env: &TestEnv,
        probe: &str,
        pod: Option<&Pod>,
        uid: u32,
        gid: u32,
        addrs: &[SocketAddr],
        label: fn(u16) -> String,
    ) -> Result<GroupId> {
        self.start_as(env, probe, pod, (uid, gid, false), addrs, label)
    }

    /// As [`Self::start`], with IP_TRANSPARENT listeners and CAP_NET_ADMIN kept for `uid`, as a
    /// proxy in TPROXY interception mode runs (iptables' TPROXY target drops packets for other
    /// listeners). A transparent listener behaves as any other for REDIRECT and sk_assign.
    #[allow(clippy::too_many_arguments)]
    pub fn start_transparent(
        &mut self,
        env: &TestEnv,
        probe: &str,
        pod: Option<&Pod>,
        uid: u32,
        gid: u32,
        addrs: &[SocketAddr],
        label: fn(u16) -> String,
    ) -> Result<GroupId> {
        self.start_as(env, probe, pod, (uid, gid, true), addrs, label)
    }

    /// As [`Self::start_transparent`] as root, for ztunnel's in-pod listeners: each socket is
    /// marked with ztunnel's mark before its bind, as ztunnel's are (in an ambient pod only
    /// ztunnel may bind its ports, and take its captured inbound).
    pub fn start_ztunnel(
        &mut self,
        env: &TestEnv,
        probe: &str,
        pod: Option<&Pod>,
        addrs: &[SocketAddr],
        label: fn(u16) -> String,
    ) -> Result<GroupId> {
        self.bind_mark = Some(ZTUNNEL_MARK);
        let started = self.start_as(env, probe, pod, (0, 0, true), addrs, label);
        self.bind_mark = None;
        started
    }

    /// Stops one listener process (its sockets close with it).
    pub fn stop(&mut self, id: GroupId) {
        self.groups.retain(|g| g.id != id.0);
    }

    fn start_as(
        &mut self,
        env: &TestEnv,
        probe: &str,
        pod: Option<&Pod>,
        (uid, gid, transparent): (u32, u32, bool),
        addrs: &[SocketAddr],
        label: fn(u16) -> String,
    ) -> Result<GroupId> {
        let list = addrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let (uid_s, gid_s) = (uid.to_string(), gid.to_string());
        let plain = [probe, "proxy", &list, "-", "--no-forward", "--v6only"];
        let with_caps = [
            "setpriv",
            "--reuid",
            &uid_s,
            "--regid",
            &gid_s,
            "--clear-groups",
            "--inh-caps",
            "+net_admin",
            "--ambient-caps",
            "+net_admin",
            probe,
            "proxy",
            &list,
            "-",
            "--no-forward",
            "--v6only",
            "--transparent",
        ];
        let mark = self.bind_mark.map(|m| m.to_string());
        let mark_args: Vec<&str> = match &mark {
            Some(m) => vec!["--bind-mark", m],
            None => Vec::new(),
        };
        let with_caps = [&with_caps[..], &mark_args].concat();
        let plain = [&plain[..], &mark_args].concat();
        let spec = if transparent {
            Spawn::new(&with_caps)
        } else {
            Spawn::new(&plain).user(uid, gid)
        };
        let mut guard = match pod {
            Some(p) => p.spawn(env, spec)?,
            None => env.spawn(spec)?,
        };
        wait_listening(&mut guard, addrs, Duration::from_secs(10))?;
        self.started += 1;
        self.groups.push(Group {
            id: self.started,
            guard,
            label,
            seen: 0,
        });
        Ok(GroupId(self.started))
    }

    /// Connections reported since the last call; waits up to `wait` for the first one.
    pub fn take(&mut self, wait: Duration) -> Result<Vec<Accepted>> {
        let deadline = Instant::now() + wait;
        loop {
            let mut got = Vec::new();
            for g in &mut self.groups {
                g.guard.ensure_running()?;
                let out = g.guard.stdout();
                let lines: Vec<&str> = out.lines().collect();
                // A line is complete once the next one started or the text ends with '\n'.
                let complete = if out.ends_with('\n') {
                    lines.len()
                } else {
                    lines.len().saturating_sub(1)
                };
                for line in &lines[g.seen.min(complete)..complete] {
                    let v: Value = serde_json::from_str(line)
                        .with_context(|| format!("listener printed {line:?}"))?;
                    let port = v["listener"]
                        .as_str()
                        .and_then(|a| a.parse::<SocketAddr>().ok())
                        .map(|a| a.port())
                        .with_context(|| format!("no listener address in {line}"))?;
                    got.push(Accepted {
                        listener: (g.label)(port),
                        line: v,
                    });
                }
                g.seen = g.seen.max(complete);
            }
            if !got.is_empty() || Instant::now() >= deadline {
                return Ok(got);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Loads conntrack up front where it is a module: whether it is loaded changes the kernel's
/// SO_ORIGINAL_DST errno (ENOPROTOOPT without it), and an oracle's rules would load it half-way.
pub fn load_conntrack() {
    if std::path::Path::new("/proc/modules").exists() {
        let _ = Command::new("modprobe").arg("nf_conntrack").status();
    }
}

/// `0.0.0.0:p` and `[::]:p` for each port: a listener group on every address of both families.
pub fn wildcard(ports: &[u16]) -> Vec<SocketAddr> {
    let v4 = ports
        .iter()
        .map(|p| SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), *p));
    let v6 = ports
        .iter()
        .map(|p| SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), *p));
    v4.chain(v6).collect()
}

/// Turns a connect probe's output and what the listeners reported into an [`Outcome`].
pub fn outcome(names: &Names, client: &Value, accepted: &[Accepted]) -> Result<Outcome> {
    if let Some(errno) = client["errno"].as_i64() {
        if !accepted.is_empty() {
            bail!("connect failed ({client}) yet a listener accepted: {accepted:?}");
        }
        return Ok(Outcome::failed(errno));
    }
    let [one] = accepted else {
        bail!("the connect succeeded ({client}); listeners reported {accepted:?}");
    };
    let peer = client["peer"].as_str().context("connect printed no peer")?;
    Ok(Outcome {
        accepted: one.listener.clone(),
        local: names.text(one.line["local"].as_str().unwrap_or("?")),
        orig_v4: names.orig(&one.line["orig_v4"]),
        orig_v6: names.orig(&one.line["orig_v6"]),
        app_peer: names.text(peer),
        source: source(names, client, &one.line),
    })
}

/// The source address both ends agree on, by name, or both ends' addresses when they do not.
fn source(names: &Names, client: &Value, accepted: &Value) -> String {
    // An IPv4-mapped address and its IPv4 form are one source (a dual-stack socket and an IPv4
    // listener each print their own).
    let parse = |v: &Value| {
        v.as_str()
            .and_then(|s| s.parse::<SocketAddr>().ok())
            .map(|a| match a.ip().to_canonical() {
                v4 @ IpAddr::V4(_) => SocketAddr::new(v4, a.port()),
                IpAddr::V6(_) => a,
            })
    };
    match (parse(&client["local"]), parse(&accepted["peer"])) {
        // Each end prints a link-local address with its own netns's interface as the scope.
        (Some(app), Some(seen)) if app.ip() == seen.ip() && app.port() == seen.port() => {
            names.ip(app.ip())
        }
        (app, seen) => format!(
            "{}!={}",
            app.map_or("?".into(), |a| names.addr(a)),
            seen.map_or("?".into(), |a| names.addr(a))
        ),
    }
}

/// Istio's iptables ruleset in a pod's netns: applied as istio-cni does (`iptables-restore
/// --noflush`, then the route commands) and removed again.
pub struct Oracle {
    netns_name: String,
    /// (ip6tables?, table) of every table a restore wrote to.
    touched: BTreeSet<(bool, String)>,
    /// Route commands that changed something, to undo.
    routes: Vec<Vec<String>>,
}

const RESTORE: [&str; 2] = ["iptables-legacy-restore", "ip6tables-legacy-restore"];
const IPTABLES: [&str; 2] = ["iptables-legacy", "ip6tables-legacy"];

impl Oracle {
    pub fn new(pod: &Pod) -> Self {
        Self {
            netns_name: pod.netns_name.clone(),
            touched: BTreeSet::new(),
            routes: Vec::new(),
        }
    }

    fn in_netns(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns_name]).args(argv);
        c
    }

    fn restore(&mut self, v6: bool, input: &str) -> Result<()> {
        if input.is_empty() {
            return Ok(());
        }
        for table in input.lines().filter_map(|l| l.strip_prefix("* ")) {
            self.touched.insert((v6, table.trim().to_owned()));
        }
        let tool = RESTORE[usize::from(v6)];
        feed(self.in_netns(&[tool, "--noflush"]), tool, input)
    }

    /// Installs the ruleset of `cap` (after removing the previous one).
    pub fn apply(&mut self, cap: &IstioCapture) -> Result<()> {
        self.apply_rules(
            &cap.try_iptables_restore_v4()?,
            &cap.try_iptables_restore_v6()?,
            &cap.route_commands(),
        )
    }

    /// Installs a ruleset given as `iptables-restore` input per family (empty: none) and `ip`
    /// commands, after removing the previous one.
    pub fn apply_rules(&mut self, v4: &str, v6: &str, routes: &[Vec<String>]) -> Result<()> {
        self.clear()?;
        self.restore(false, v4)?;
        self.restore(true, v6)?;
        for argv in routes {
            let args: Vec<&str> = argv.iter().map(String::as_str).collect();
            let out = self.in_netns(&args).output()?;
            let err = String::from_utf8_lossy(&out.stderr);
            if out.status.success() {
                self.routes.push(argv.clone());
            } else if !err.contains("File exists") && !err.contains("already assigned") {
                bail!("`{}` failed: {err}", argv.join(" "));
            }
        }
        Ok(())
    }

    /// Flushes and deletes the chains of every table a restore touched, and undoes the routes.
    pub fn clear(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for (v6, table) in &self.touched {
            let tool = IPTABLES[usize::from(*v6)];
            for op in ["-F", "-X"] {
                match self.in_netns(&[tool, "-t", table, op]).output() {
                    Ok(o) if o.status.success() => {}
                    Ok(o) => errors.push(format!(
                        "{tool} -t {table} {op}: {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    )),
                    Err(e) => errors.push(format!("{tool}: {e}")),
                }
            }
        }
        for argv in std::mem::take(&mut self.routes) {
            let undo: Vec<&str> = argv
                .iter()
                .map(|a| if a == "add" { "del" } else { a.as_str() })
                .collect();
            if let Err(e) = self.in_netns(&undo).output() {
                errors.push(format!("`{}`: {e}", undo.join(" ")));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("clearing the oracle's rules: {}", errors.join("; "))
        }
    }

    /// The rules of every touched table, as `iptables-save` prints them (for messages).
    pub fn dump(&self) -> String {
        let mut out = String::new();
        for v6 in [false, true] {
            let tool = if v6 {
                "ip6tables-legacy-save"
            } else {
                "iptables-legacy-save"
            };
            if let Ok(o) = self.in_netns(&[tool]).output() {
                out.push_str(&String::from_utf8_lossy(&o.stdout));
            }
        }
        out
    }

    /// Whether no rule of ours is left in the touched tables.
    pub fn is_clear(&self) -> Result<bool> {
        for (v6, table) in &self.touched {
            let tool = IPTABLES[usize::from(*v6)];
            let out = self.in_netns(&[tool, "-t", table, "-S"]).output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            if text.lines().any(|l| !l.starts_with("-P ")) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Drop for Oracle {
    fn drop(&mut self) {
        if let Err(e) = self.clear() {
            eprintln!("sidestep-tests: {e:#}");
        }
    }
}

/// Runs `c` with `input` on its stdin; fails naming `what` and the input unless it succeeds.
fn feed(mut c: Command, what: &str, input: &str) -> Result<()> {
    let mut child = c
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {what}"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}\ninput:\n{input}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Istio's native nftables ruleset in a pod's netns (`nft -f`, with the `::6` address its
/// sidecar mode adds as the iptables mode does), removed again on [`NftRules::clear`] and drop.
pub struct NftRules {
    netns_name: String,
    applied: bool,
}

impl NftRules {
    pub fn new(pod: &Pod) -> Self {
        Self {
            netns_name: pod.netns_name.clone(),
            applied: false,
        }
    }

    fn nft(&self, input: &str) -> Result<()> {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns_name, "nft", "-f", "-"]);
        feed(c, "nft -f", input)
    }

    pub fn apply(&mut self, ruleset: &str) -> Result<()> {
        self.nft(ruleset)?;
        self.applied = true;
        let _ = Command::new("ip")
            .args(["netns", "exec", &self.netns_name])
            .args(["ip", "-6", "addr", "add", "::6/128", "dev", "lo"])
            .output();
        Ok(())
    }

    pub fn clear(&mut self) -> Result<()> {
        if std::mem::take(&mut self.applied) {
            self.nft(&crate::istio_nftables::delete())?;
            let _ = Command::new("ip")
                .args(["netns", "exec", &self.netns_name])
                .args(["ip", "-6", "addr", "del", "::6/128", "dev", "lo"])
                .output();
        }
        Ok(())
    }
}

impl Drop for NftRules {
    fn drop(&mut self) {
        if let Err(e) = self.clear() {
            eprintln!("sidestep-tests: {e:#}");
        }
    }
}

/// Writes `text` to the process's stdout directly, past the test harness's capture, so the
/// table shows up in every test run's output.
pub fn print_uncaptured(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// Lays out rows of cells as an aligned text table with a header and a rule below it.
pub fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < width.len() {
                width[i] = width[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| -> String {
        let parts: Vec<String> = cells.zip(&width).map(|(c, w)| format!("{c:<w$}")).collect();
        parts.join(" | ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&mut header.iter().copied());
    let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
    out.push_str(&(rule.join("-+-") + "\n"));
    for r in rows {
        out.push_str(&line(&mut r.iter().map(String::as_str)));
    }
    out
}
