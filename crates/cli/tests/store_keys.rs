//! `tally store create`, `create-key` and `revoke-key` against a running server.

mod common;

use common::*;

const TOKEN: &str = "a-long-enough-admin-token-for-the-test-0123";

fn run(args: &[&str]) -> String {
    let output = tally().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "{args:?}: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn after<'a>(text: &'a str, label: &str) -> &'a str {
    text.split(label)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{label} in {text}"))
        .trim_end_matches(',')
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_keys_are_created_restricted_and_revoked_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let served = serve_with(dir.path(), &["--admin-token", TOKEN]);
    let base = served.prod_url.clone();
    let created = run(&[
        "store",
        "create",
        "--name",
        "cli",
        "--base-url",
        &base,
        "--admin-token",
        TOKEN,
    ]);
    let store_id = created
        .split('(')
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap()
        .to_string();
    let key = run(&[
        "store",
        "create-key",
        "--store",
        &store_id,
        "--mode",
        "test",
        "--permission",
        "meters:read",
        "--base-url",
        &base,
        "--admin-token",
        TOKEN,
    ]);
    let key_id = after(&key, "Created key ").to_string();
    let secret = key.lines().last().unwrap().trim().to_string();
    assert!(secret.starts_with("tally_test_"), "{key}");
    let http = reqwest::Client::new();
    let test = served.test_url.clone();
    assert_eq!(
        get(&http, &format!("{test}/v1/meters"), &secret).await.0,
        200
    );
    assert_eq!(
        get(&http, &format!("{test}/v1/customers"), &secret).await.0,
        403
    );
    run(&[
        "store",
        "revoke-key",
        "--store",
        &store_id,
        "--key",
        &key_id,
        "--base-url",
        &base,
        "--admin-token",
        TOKEN,
    ]);
    assert_eq!(
        get(&http, &format!("{test}/v1/meters"), &secret).await.0,
        401
    );
    assert!(served.terminate().success());
}
