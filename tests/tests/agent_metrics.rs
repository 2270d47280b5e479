//! The plugin's invocations in the agent's /metrics: real ADDs and DELs through the CNI chain the
//! agent installed are counted by command and result, with latency histograms whose buckets,
//! count and sum agree with what the test itself timed; invocations made while the agent is
//! down are counted once it is back; uninstall leaves no timing file. The data-path part is
//! walked at most once per `metrics-max-age`, however many scrapes come and however
//! concurrently, and refreshed after it. Needs root.

mod agent_support;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use agent_support::{Agent, Dirs, base_args, free_port, http_get, meshed, samples, wait_until};
use anyhow::{Context as _, Result, ensure};
use sidestep_tests::{TestEnv, skip_unless_root};

const HIST: &str = "sidestep_cni_operation_duration_seconds";

/// The operations of `command` with `result`, summed over their CNI error codes (`code`, on
/// failures only).
fn ops(s: &BTreeMap<String, f64>, command: &str, result: &str) -> f64 {
    let prefix = format!(r#"sidestep_cni_operations_total{{command="{command}",result="{result}""#);
    s.iter()
        .filter(|(k, _)| {
            k.strip_prefix(&prefix)
                .is_some_and(|rest| rest == "}" || rest.starts_with(",code="))
        })
        .map(|(_, v)| v)
        .sum()
}

/// The CNI error codes `command`'s failures carry in the `code` label.
fn error_codes(s: &BTreeMap<String, f64>, command: &str) -> Vec<String> {
    let prefix =
        format!(r#"sidestep_cni_operations_total{{command="{command}",result="error",code=""#);
    s.keys()
        .filter_map(|k| k.strip_prefix(&prefix))
        .map(|rest| rest.trim_end_matches("\"}").to_owned())
        .collect()
}

/// (bucket bounds with their cumulative counts, count, sum) of one histogram series.
fn histogram(
    s: &BTreeMap<String, f64>,
    command: &str,
    result: &str,
) -> (Vec<(f64, f64)>, f64, f64) {
    let labels = format!(r#"command="{command}",result="{result}""#);
    let mut buckets: Vec<(f64, f64)> = s
        .iter()
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix(&format!("{HIST}_bucket{{le=\""))?;
            let (le, tail) = rest.split_once("\",")?;
            (tail == format!("{labels}}}")).then(|| {
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                (le, *v)
            })
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let get = |suffix: &str| {
        s.get(&format!("{HIST}_{suffix}{{{labels}}}"))
            .copied()
            .unwrap_or(0.0)
    };
    (buckets, get("count"), get("sum"))
}

#[test]
fn agent_counts_and_times_the_plugins_adds_and_dels() -> Result<()> {
    if skip_unless_root("agent_counts_and_times_the_plugins_adds_and_dels") {
        return Ok(());
    }
    let env = TestEnv::new("agent-metrics")?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let args = base_args(&env, &d, port);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let entry = d.entry("10-test.conflist")?;
    let node = d.node(&env, "10-test.conflist")?;

    // Real ADDs and DELs through the chain; the test times each whole chain invocation, which
    // contains the plugin's own time.
    const PODS: usize = 4;
    let mut chain_add = Duration::ZERO;
    let mut chain_del = Duration::ZERO;
    let mut pods = Vec::new();
    for i in 0..PODS {
        let t = Instant::now();
        pods.push(node.add_pod_with(&format!("m{i}"), meshed())?);
        chain_add += t.elapsed();
    }
    // Two of them go away again; the other two stay enrolled for a while.
    for p in pods.drain(..2) {
        let t = Instant::now();
        node.remove_pod(&p)?;
        chain_del += t.elapsed();
    }
    agent_support::failing_add(&d, &entry, "metrics-bad-netns")?;

    let want = |s: &BTreeMap<String, f64>| {
        ops(s, "ADD", "ok") == PODS as f64
            && ops(s, "DEL", "ok") == 2.0
            && ops(s, "ADD", "error") == 1.0
            // The failure says which CNI error it was; a success carries no code.
            && error_codes(s, "ADD").len() == 1
            && error_codes(s, "ADD").iter().all(|c| c.parse::<u32>().is_ok_and(|c| c > 0))
    };
    wait_until("the counts in /metrics", Duration::from_secs(5), || {
        Ok(want(&samples(&agent)?))
    })
    .with_context(|| format!("{:?}", samples(&agent)))?;
    let s = samples(&agent)?;
    for (cmd, result, n, outer) in [
        ("ADD", "ok", PODS as f64, Some(chain_add)),
        ("DEL", "ok", 2.0, Some(chain_del)),
        ("ADD", "error", 1.0, None),
    ] {
        let (buckets, count, sum) = histogram(&s, cmd, result);
        ensure!(count == n, "{cmd} {result}: count {count}, want {n}");
        ensure!(
            buckets.len() >= 10
                && buckets
                    .last()
                    .is_some_and(|b| b.0.is_infinite() && b.1 == n),
            "{cmd} {result}: buckets {buckets:?}"
        );
        ensure!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "{cmd} {result}: buckets not cumulative: {buckets:?}"
        );
        ensure!(sum > 0.0, "{cmd} {result}: sum {sum}");
        if let Some(outer) = outer {
            ensure!(
                sum <= outer.as_secs_f64(),
                "{cmd} {result}: the plugin reports {sum}s, more than the {outer:?} the whole \
                 chain took"
            );
        }
        let median = buckets
            .iter()
            .find(|b| b.1 * 2.0 >= n)
            .map_or(f64::NAN, |b| b.0);
        eprintln!(
            "{cmd} {result}: {count} calls, mean {:.1} ms, median <= {median} s",
            sum / count * 1e3
        );
    }
    let (_, body) = agent.get("/metrics")?;
    let excerpt: Vec<&str> = body
        .lines()
        .filter(|l| l.contains("sidestep_cni_operation") && l.contains("ADD"))
        .collect();
    eprintln!("{}", excerpt.join("\n"));

    // The agent is down while the runtime deletes the other two pods: counted when it is back.
    agent.child.terminate(Duration::from_secs(10))?;
    for p in pods.drain(..) {
        node.remove_pod(&p)?;
    }
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    wait_until("the counts after a restart", Duration::from_secs(5), || {
        let s = samples(&agent)?;
        Ok(ops(&s, "DEL", "ok") == 4.0 && ops(&s, "ADD", "ok") == PODS as f64)
    })
    .with_context(|| format!("{:?}", samples(&agent)))?;
    ensure!(
        samples(&agent)?
            .get("sidestep_cni_timing_records_malformed_total")
            .copied()
            == Some(0.0)
    );
    agent.child.terminate(Duration::from_secs(10))?;

    agent_support::uninstall(&env, &d)?;
    ensure!(
        !d.state.join("timings").exists(),
        "uninstall left the timing file"
    );
    Ok(())
}

const WALKS: &str = "sidestep_metrics_datapath_walks_total";

/// `n` scrapes at once, each parsed: every one's samples.
fn concurrent_scrapes(agent: &Agent, n: usize) -> Result<Vec<BTreeMap<String, f64>>> {
    let addr = agent.addr;
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..n)
            .map(|_| s.spawn(move || http_get(addr, "/metrics")))
            .collect();
        threads
            .into_iter()
            .map(|t| {
                let (code, body) = t.join().map_err(|_| anyhow::anyhow!("scrape panicked"))??;
                ensure!(code == 200, "/metrics answered {code}");
                Ok(body
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    .filter_map(|l| {
                        let (k, v) = l.rsplit_once(' ')?;
                        Some((k.to_owned(), v.parse().ok()?))
                    })
                    .collect())
            })
            .collect()
    })
}

fn value(s: &BTreeMap<String, f64>, name: &str) -> Result<f64> {
    s.get(name)
        .copied()
        .with_context(|| format!("no {name} in /metrics"))
}

fn pod_series(s: &BTreeMap<String, f64>, cookie: u64) -> bool {
    s.keys().any(|k| {
        k.starts_with("sidestep_pod_redirected_outbound_total{")
            && k.contains(&format!("netns_cookie=\"{cookie}\""))
    })
}

#[test]
fn agent_walks_the_data_path_once_per_max_age() -> Result<()> {
    if skip_unless_root("agent_walks_the_data_path_once_per_max_age") {
        return Ok(());
    }
    // Long enough for the second pod's ADD and the burst on a loaded 2-core machine (a CNI ADD
    // through the chain took seconds there); the second half waits it out once.
    const MAX_AGE: Duration = Duration::from_secs(20);
    const SCRAPES: usize = 24;
    let env = TestEnv::new("agent-metrics-cache")?;
    let d = Dirs::new(&env)?;
    d.write_primary("10-test.conflist")?;
    let port = free_port()?;
    let mut args = base_args(&env, &d, port);
    args.extend([
        "--metrics-max-age".into(),
        format!("{}s", MAX_AGE.as_secs()),
    ]);
    let mut agent = Agent::start(&env, &args, port)?;
    agent.wait_ready(Duration::from_secs(30))?;
    let node = d.node(&env, "10-test.conflist")?;
    let first = node.add_pod_with("c0", meshed())?;

    // The first scrape walks, between these two instants.
    let walk_after = Instant::now();
    let s = samples(&agent)?;
    let fresh_at = Instant::now();
    let walks = value(&s, WALKS)?;
    ensure!(
        walks >= 1.0 && value(&s, "sidestep_pods_enrolled")? == 1.0,
        "{s:?}"
    );
    ensure!(pod_series(&s, first.netns_cookie()?));

    // A second pod enrols; a burst of scrapes, concurrent and one after another, within the
    // max age: no walk, so none of them sees it yet.
    let second = node.add_pod_with("c1", meshed())?;
    let mut burst = concurrent_scrapes(&agent, SCRAPES)?;
    for _ in 0..SCRAPES {
        burst.push(samples(&agent)?);
    }
    let took = walk_after.elapsed();
    ensure!(
        took < MAX_AGE,
        "the burst took {took:?}, longer than the max age {MAX_AGE:?}: too slow to judge"
    );
    for s in &burst {
        ensure!(
            value(s, WALKS)? == walks && value(s, "sidestep_pods_enrolled")? == 1.0,
            "a scrape within the max age walked: walks {} (was {walks}), enrolled {}",
            value(s, WALKS)?,
            value(s, "sidestep_pods_enrolled")?
        );
    }
    eprintln!(
        "{} scrapes in {took:?}: {walks} walk(s), the second pod not yet seen",
        burst.len()
    );

    // After the max age, concurrent scrapes share one walk, and all see the second pod.
    std::thread::sleep(MAX_AGE.saturating_sub(fresh_at.elapsed()) + Duration::from_millis(200));
    let after = concurrent_scrapes(&agent, SCRAPES)?;
    for s in &after {
        ensure!(
            value(s, WALKS)? == walks + 1.0 && value(s, "sidestep_pods_enrolled")? == 2.0,
            "after the max age: walks {} (want {}), enrolled {}",
            value(s, WALKS)?,
            walks + 1.0,
            value(s, "sidestep_pods_enrolled")?
        );
        ensure!(pod_series(s, second.netns_cookie()?));
    }
    eprintln!("{SCRAPES} concurrent scrapes after the max age: one walk, both pods seen");

    node.remove_pod(&second)?;
    node.remove_pod(&first)?;
    agent.child.terminate(Duration::from_secs(10))?;
    agent_support::uninstall(&env, &d)?;
    Ok(())
}
