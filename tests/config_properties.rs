//! Properties of the reader over random input: `parse` never panics, and
//! either returns settings that `run` can use as they are (every deadline
//! computable, every pattern list compilable) or a non-empty list of
//! problems, each naming the file and, where it has one, a place inside the
//! text.

use std::path::Path;
use std::time::Instant;

use proptest::prelude::*;
use proptest::sample::select;

use vllm_warden::config::*;
use vllm_warden::supervisor::classify::Classifier;

const FILE: &str = "/etc/vllm-warden/p.toml";

fn holds(text: &str) -> Result<(), TestCaseError> {
    match parse(text, Path::new(FILE), &Dirs::default()) {
        Ok(s) => {
            prop_assert!(s.child.command.first().is_some_and(|p| !p.is_empty()));
            prop_assert!(s.prestart.port.is_some_and(|p| p > 0));
            let durations = [
                s.child.stop_timeout,
                s.prestart.port_wait,
                s.prestart.gpu_idle_wait,
                s.ready.timeout,
                s.ready.stall,
                s.fatal.grace,
                s.restart.initial_delay,
                s.restart.max_delay,
                s.restart.reset_after,
                s.health.interval,
                s.health.timeout,
                s.health.canary_interval,
                s.health.canary_timeout,
                s.health.progress_stall,
            ];
            let now = Instant::now();
            for d in durations {
                prop_assert!(d <= limits::LONGEST, "{d:?}");
                prop_assert!(now.checked_add(d * 2).is_some(), "{d:?}");
            }
            prop_assert!(s.restart.factor.is_finite() && s.restart.jitter.is_finite());
            // The profile's own lists compile (a unit test says so); the
            // config's additions are what could break them.
            if s.patterns != s.profile.patterns() {
                prop_assert!(Classifier::new(&s.patterns).is_ok());
            }
        }
        Err(p) => {
            prop_assert!(!p.0.is_empty());
            let lines = text.split('\n').count();
            for q in &p.0 {
                prop_assert_eq!(q.file.as_path(), Path::new(FILE));
                prop_assert!(!q.message.is_empty());
                if let Some((line, col)) = q.at {
                    prop_assert!((1..=lines).contains(&line) && col >= 1, "{q}");
                }
            }
        }
    }
    Ok(())
}

/// Text made of TOML's own characters and words, so that much of it
/// parses as TOML and reaches the reader.
fn tomlish() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        select(vec![
            "[child]",
            "[[patch]]",
            "[prestart]",
            "[ready]",
            "[fatal]",
            "[restart]",
            "[health]",
            "[status]",
            "\n",
            "\n",
            "\n",
            " = ",
            "=",
            "[",
            "]",
            "{",
            "}",
            ",",
            "\"",
            "'",
            "\\",
            ".",
            "#",
            "command",
            "stop-timeout",
            "stop-signal",
            "remove",
            "set",
            "file",
            "port",
            "timeout",
            "stall",
            "interval",
            "match",
            "log",
            "name",
            "profile",
            "gpu-query",
            "factor",
            "\"vllm\"",
            "\"90s\"",
            "\"0s\"",
            "\"5y\"",
            "\"SIGKILL\"",
            "1",
            "-1",
            "1e400",
            "nan",
            "inf",
            "0x7fffffffffffffff",
            "true",
            "1979-05-27",
            "\"\\\\\"",
            "\"é\"",
            "'''",
            "\"\"\"",
        ])
        .prop_map(String::from),
        "[a-z0-9_-]{1,8}",
    ];
    prop::collection::vec(token, 0..60).prop_map(|t| t.concat())
}

/// The example config with a few characters changed. Its pattern lists
/// are left out: compiling them in every case would make the test slow, and
/// the random configs below cover them.
fn mutated_example() -> impl Strategy<Value = String> {
    let example: String = include_str!("../examples/kimi-k2.5-nvfp4.toml")
        .lines()
        .filter(|l| !l.starts_with("match") && !l.starts_with("ignore"))
        .map(|l| format!("{l}\n"))
        .collect();
    let edit = (0..example.len(), 0usize..4, "\\PC{0,3}");
    prop::collection::vec(edit, 1..4).prop_map(move |edits| {
        let mut text = example.clone();
        for (at, cut, insert) in edits {
            let mut at = at.min(text.len());
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            let mut end = (at + cut).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            text.replace_range(at..end, &insert);
        }
        text
    })
}

fn quoted(s: impl AsRef<str>) -> String {
    format!("\"{}\"", s.as_ref())
}

/// Any TOML value, valid for some key or for none.
fn any_value() -> impl Strategy<Value = String> {
    let unit = select(vec!["ns", "us", "ms", "s", "m", "h", "d", "w", "M", "y", ""]);
    let leaf = prop_oneof![
        (any::<u64>(), unit.clone()).prop_map(|(n, u)| quoted(format!("{n}{u}"))),
        (0u64..10_000, unit).prop_map(|(n, u)| quoted(format!("{n}{u}"))),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|x| if x.is_finite() { format!("{x:?}") } else { "nan".into() }),
        any::<bool>().prop_map(|b| b.to_string()),
        "[ -!#-\\[\\]-~]{0,12}".prop_map(quoted),
        select(vec![
            "\"SIGTERM\"",
            "\"SIGKILL\"",
            "\"STOP\"",
            "\"9\"",
            "\"0\"",
            "\"SIGFOO\"",
            "\"\"",
            "\"http://127.0.0.1:1/h\"",
            "\"ftp://x\"",
            "\"(\"",
            "\"a+\"",
            "\"\\\\w{150}\"",
            "\"a..b\"",
            "\".\"",
            "\"a\\\\\"",
            "\"*\"",
            "\"x/y\"",
        ])
        .prop_map(String::from),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec(("[a-z.]{0,4}", inner), 0..3).prop_map(|kv| {
                let kv: Vec<String> = kv.into_iter().map(|(k, v)| format!("{} = {v}", quoted(k))).collect();
                format!("{{{}}}", kv.join(", "))
            }),
        ]
    })
}

/// A value that suits `key` far more often than not, so that about half
/// the random configs are valid.
fn value_for(key: &'static str) -> BoxedStrategy<String> {
    let strings = |v: Vec<&'static str>| select(v).prop_map(String::from).boxed();
    let likely = match key {
        "command" | "gpu-query" => strings(vec!["[\"vllm\", \"serve\"]", "[\"/bin/true\"]"]),
        "stop-signal" => strings(vec!["\"SIGTERM\"", "\"INT\"", "\"2\""]),
        "port" => (1u32..65_536).prop_map(|n| n.to_string()).boxed(),
        "factor" => (1.0f64..100.0).prop_map(|x| format!("{x:?}")).boxed(),
        "jitter" => (0.0f64..1.0).prop_map(|x| format!("{x:?}")).boxed(),
        "max-attempts" | "permanent-attempts" | "failures" => (1u64..5).prop_map(|n| n.to_string()).boxed(),
        "log" | "progress" | "match" | "ignore" | "permanent" | "clean-shm" | "remove" => {
            prop::collection::vec(select(vec!["\"a+\"", "\"x_*\"", "\"b.c\""]), 1..3)
                .prop_map(|v| format!("[{}]", v.join(", ")))
                .boxed()
        }
        "http" => strings(vec!["\"\"", "\"http://127.0.0.1:9/health\""]),
        "env" => strings(vec!["{ A = \"1\" }", "{}"]),
        "set" => strings(vec!["{ \"b.c\" = 2, a = [true, 1.5] }"]),
        "profile" => strings(vec!["\"vllm\"", "\"none\""]),
        "name" => strings(vec!["\"kimi\"", "\"a.b-c_d\""]),
        "cwd" | "log-file" | "file" | "metrics-file" | "cache-dir" => strings(vec!["\"/tmp/x\"", "\"\""]),
        _ => (1u64..30, select(vec!["ms", "s", "m", "h"])).prop_map(|(n, u)| quoted(format!("{n}{u}"))).boxed(),
    };
    prop_oneof![40 => likely, 1 => any_value()].boxed()
}

/// `header`, then `required` and some of `keys` (and sometimes an unknown
/// one), with values.
fn section(
    header: &'static str,
    required: &'static [&'static str],
    keys: &'static [&'static str],
) -> BoxedStrategy<String> {
    let line = |k: &'static str| value_for(k).prop_map(move |v| format!("{k} = {v}\n"));
    let required: Vec<_> = required.iter().map(|&k| line(k)).collect();
    let optional: Vec<_> = keys
        .iter()
        .map(|&k| {
            // A pattern list is compiled whenever a config extends it, which
            // is slow enough to keep rare here (the unit tests cover them).
            let chance = if ["log", "progress", "match", "ignore", "permanent"].contains(&k) { 0.01 } else { 0.5 };
            prop::option::weighted(chance, line(k)).prop_map(Option::unwrap_or_default)
        })
        .collect();
    let unknown = prop_oneof![30 => Just(""), 1 => Just("zz = 1\n")];
    (required, optional, unknown).prop_map(move |(r, o, u)| format!("{header}{}{}{u}", r.concat(), o.concat())).boxed()
}

/// A config of known sections and keys with random values.
fn structured() -> impl Strategy<Value = String> {
    let sections = (
        section("", &[], &["name", "profile"]),
        section("[child]\n", &["command"], &["env", "cwd", "cache-dir", "log-file", "stop-signal", "stop-timeout"]),
        prop::collection::vec(section("[[patch]]\n", &["file"], &["remove", "set"]), 0..3),
        section("[prestart]\n", &[], &["clean-shm", "port", "port-wait", "gpu-idle-wait", "gpu-query"]),
        section("[ready]\n", &[], &["log", "http", "timeout", "stall", "progress"]),
        section("[fatal]\n", &[], &["match", "ignore", "permanent", "grace"]),
        section(
            "[restart]\n",
            &[],
            &["initial-delay", "max-delay", "factor", "jitter", "reset-after", "max-attempts", "permanent-attempts"],
        ),
        section("[health]\n", &[], &["http", "interval", "timeout", "failures", "canary-interval", "canary-timeout"]),
        section("[status]\n", &[], &["file", "metrics-file"]),
    );
    sections.prop_map(|(top, child, patches, prestart, ready, fatal, restart, health, status)| {
        [top, child, patches.concat(), prestart, ready, fatal, restart, health, status].concat()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn parse_never_panics_on_arbitrary_text(text in prop_oneof![any::<String>(), tomlish(), mutated_example()]) {
        holds(&text)?;
    }

    #[test]
    fn parse_never_panics_on_random_configs(text in structured()) {
        holds(&text)?;
    }
}

#[test]
fn the_random_configs_reach_both_outcomes() {
    // Without this, a generator that only ever makes invalid configs would
    // leave the properties of valid ones untested.
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut ok, mut err) = (0, 0);
    for _ in 0..300 {
        let Ok(tree) = structured().new_tree(&mut runner) else { continue };
        match parse(&tree.current(), Path::new(FILE), &Dirs::default()) {
            Ok(_) => ok += 1,
            Err(_) => err += 1,
        }
    }
    assert!(ok > 10 && err > 10, "{ok} valid, {err} invalid");
}
