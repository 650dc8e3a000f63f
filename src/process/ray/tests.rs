use super::*;
use crate::config::command::{address_in, valid_address};

fn cluster() -> Cluster {
    Cluster {
        address: "127.0.0.3:6391".into(),
        python: "python3".into(),
        gate: true,
        min_nodes: 2,
        min_cpus: 2.0,
        min_gpus: 0.0,
        wait: Duration::from_secs(600),
    }
}

#[test]
fn an_answer_without_json_is_the_error_on_its_last_line() {
    let e = parse_answer("Traceback ...\nConnectionError: Could not find any running Ray instance.\n\n")
        .unwrap_err()
        .to_string();
    assert_eq!(e, "ConnectionError: Could not find any running Ray instance.");
    assert_eq!(parse_answer("").unwrap_err().to_string(), "no output");
}

#[test]
fn what_is_missing_is_named() {
    let c = cluster();
    let v = ClusterView { nodes: 1, cpus: (1.0, 1.0), ..ClusterView::default() };
    assert_eq!(c.missing(&v).unwrap(), "1 of 2 nodes alive, 1 of 2 CPUs free (1 in the cluster)");
    let v = ClusterView { nodes: 2, cpus: (2.0, 2.0), ..ClusterView::default() };
    assert_eq!(c.missing(&v), None);
    let gpus = Cluster { min_gpus: 8.0, ..cluster() };
    let v = ClusterView { nodes: 2, cpus: (2.0, 2.0), gpus: (0.5, 8.0), ..ClusterView::default() };
    assert_eq!(gpus.missing(&v).unwrap(), "0.5 of 8 GPUs free (8 in the cluster)");
}

#[test]
fn addresses_come_from_a_nodes_command() {
    let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    let head = argv("ray start --head --block --port=6391 --node-ip-address=127.0.0.3");
    assert_eq!(address_in(&head, true).unwrap(), "127.0.0.3:6391");
    assert_eq!(address_in(&argv("ray start --head --block"), true).unwrap(), "127.0.0.1:6379");
    assert_eq!(address_in(&argv("ray start --head --node-ip-address ::1"), true).unwrap(), "[::1]:6379");
    let worker = argv("ray start --address=127.0.0.3:6391 --block");
    assert_eq!(address_in(&worker, false).unwrap(), "127.0.0.3:6391");
    assert_eq!(address_in(&argv("ray start --block"), false), None);
}

#[test]
fn only_host_and_port_are_addresses() {
    for ok in ["127.0.0.3:6391", "head-1.cluster:6379", "[::1]:6379"] {
        assert!(valid_address(ok), "{ok}");
    }
    for bad in ["127.0.0.3", ":6379", "head:0", "head:65536", "-x:1", "a b:1", "[zz]:1", "head:port"] {
        assert!(!valid_address(bad), "{bad}");
    }
}

#[test]
fn the_python_is_found_beside_the_childs_program() {
    let dir = tempfile::tempdir().unwrap();
    let python = dir.path().join("python3");
    std::fs::write(&python, "#!/bin/sh\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let child = vec![dir.path().join("vllm").to_string_lossy().into_owned(), "serve".into()];
    let argv = cluster().command(&child);
    assert_eq!(argv[0], python.to_string_lossy());
    assert_eq!((argv[1].as_str(), argv[3].as_str(), argv.len()), ("-c", "127.0.0.3:6391", 4));
    assert!(argv[2].contains("GcsClient(address=sys.argv[1])"));
    // A child run from PATH: the Python from PATH too.
    assert_eq!(cluster().command(&["vllm".into()])[0], "python3");
    // Not executable: not taken.
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(cluster().command(&child)[0], "python3");
}

#[test]
fn sessions_in_use_are_kept_and_links_are_never_followed() {
    use std::os::unix::fs::symlink;
    let uid = nix::unistd::geteuid().as_raw();
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::write(elsewhere.path().join("precious"), "x").unwrap();
    let (used, unused) =
        (dir.path().join("session_2026-11-30_10-00-00_1"), dir.path().join("session_2026-11-30_11-00-00_2"));
    for d in [&used, &unused] {
        std::fs::create_dir_all(d.join("logs")).unwrap();
        std::fs::write(d.join("logs/raylet.out"), "line\n").unwrap();
    }
    // A link inside a session leads out of it: removing the session
    // removes the link, not what it names.
    symlink(elsewhere.path(), unused.join("logs/out")).unwrap();
    symlink(&unused, dir.path().join("session_latest")).unwrap();
    // A session name that is a link is not a session folder.
    symlink(elsewhere.path(), dir.path().join("session_planted")).unwrap();
    std::fs::write(dir.path().join("ray_current_cluster"), "127.0.0.3:6391").unwrap();
    std::fs::write(dir.path().join("other"), "kept").unwrap();
    let held = std::fs::File::open(used.join("logs/raylet.out")).unwrap();

    let report = clean_sessions(dir.path(), uid);
    assert_eq!(report.removed, vec![unused.clone(), dir.path().join("session_latest")]);
    assert_eq!(report.kept.len(), 1, "{report:?}");
    assert!(report.kept[0].1.starts_with(&format!("in use by pid {}", std::process::id())), "{report:?}");
    assert!(used.is_dir() && !unused.exists());
    assert!(elsewhere.path().join("precious").exists());
    assert!(dir.path().join("session_planted").exists() && dir.path().join("ray_current_cluster").exists());

    drop(held);
    let report = clean_sessions(dir.path(), uid);
    assert_eq!(report.removed, vec![used.clone(), dir.path().join("ray_current_cluster")]);
    assert!(dir.path().join("other").exists() && dir.path().join("session_planted").exists());
    assert!(elsewhere.path().join("precious").exists());
}

#[test]
fn the_temp_dir_is_where_ray_puts_it() {
    let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    let mut env = std::collections::BTreeMap::new();
    assert_eq!(temp_dir(&argv("ray start --temp-dir=/srv/ray-head"), &env), Path::new("/srv/ray-head"));
    env.insert("TMPDIR".to_string(), "/scratch".to_string());
    assert_eq!(temp_dir(&argv("ray start --head"), &env), Path::new("/scratch/ray"));
    env.insert("RAY_TMPDIR".to_string(), "/fast/ray-tmp".to_string());
    assert_eq!(temp_dir(&argv("ray start --head"), &env), Path::new("/fast/ray-tmp"));
}

/// Real answers of Ray 2.56.1's GCS to the look: two nodes of one CPU
/// each; the same after the second node was killed and the GCS marked it
/// dead (its resources then show none free); its client's error when no
/// GCS answers.
#[test]
fn real_answers_are_read() {
    let two = include_str!("../../../tests/fixtures/ray/gcs-two-nodes.json");
    let both = vec!["127.0.0.3".to_string(), "127.0.0.2".to_string()];
    assert_eq!(parse_answer(two).unwrap(), ClusterView { nodes: 2, alive: both, cpus: (2.0, 2.0), gpus: (0.0, 0.0) });
    let dead = include_str!("../../../tests/fixtures/ray/gcs-one-dead.json");
    let head = vec!["127.0.0.3".to_string()];
    assert_eq!(parse_answer(dead).unwrap(), ClusterView { nodes: 1, alive: head, cpus: (1.0, 1.0), gpus: (0.0, 0.0) });
    let none = include_str!("../../../tests/fixtures/ray/status_no_head.txt");
    assert_eq!(
        parse_answer(none).unwrap_err().to_string(),
        "ray.exceptions.RpcError: Timed out while waiting for GCS to become available."
    );
    // Warnings of Ray's client before the answer are passed over; a line
    // that is not the answer is said so.
    let warned = format!("[2026-11-30 17:16:18,596 W 1 1] rpc_client.h:153: slow\n{two}");
    assert_eq!(parse_answer(&warned).unwrap().nodes, 2);
    assert!(parse_answer("{\"nodes\": 3}").unwrap_err().to_string().starts_with("not the answer asked for: "));
}

/// A node is in its cluster at its own address, or by count when Ray
/// chose its address.
#[test]
fn a_member_is_seen_by_address_or_by_count() {
    let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    let worker = Member::of(&argv("ray start --address=127.0.0.3:6391 --node-ip-address=127.0.0.2"), false);
    assert_eq!(worker, Member::At("127.0.0.2".into()));
    let dead = parse_answer(include_str!("../../../tests/fixtures/ray/gcs-one-dead.json")).unwrap();
    let two = parse_answer(include_str!("../../../tests/fixtures/ray/gcs-two-nodes.json")).unwrap();
    assert!(!worker.seen(&dead) && worker.seen(&two));
    assert_eq!(Member::of(&argv("ray start --head"), true), Member::Count(1));
    assert_eq!(Member::of(&argv("ray start --address=h:1"), false), Member::Count(2));
    assert!(Member::Count(2).seen(&two) && !Member::Count(2).seen(&dead));
}

#[tokio::test]
async fn an_address_where_nothing_listens_is_named_without_asking_ray() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // The look would not be run: the program does not exist.
    let address = format!("127.0.0.1:{port}");
    let argv = ["/nonexistent/python3".to_string(), "-c".into(), "pass".into(), address.clone()];
    let e = ask(&argv, &address).await.unwrap_err().to_string();
    assert!(e.starts_with(&format!("nothing answers at 127.0.0.1:{port} (Connection refused")), "{e}");
    let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let e = ask(&argv, &address).await.unwrap_err().to_string();
    assert_eq!(e, "/nonexistent/python3 not found");
    drop(l);
}
