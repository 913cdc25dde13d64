//! The typed client (`tally-client`) against a real server: every operation it
//! offers decodes the real answers, and API errors come back with their codes.

mod common;

use common::*;
use tally_client::*;

#[tokio::test]
async fn every_client_operation_works_against_the_server() {
    let (_dir, path) = temp_dir();
    let server = Server::start(&path, default_config()).await;

    let admin = Client::admin(&server.prod_url, "admin-secret");
    let store = admin.create_store("client").await.unwrap();
    assert_eq!(store.object, "store");
    let key = admin
        .create_key(
            &store.id,
            &KeyCreate {
                mode: "test".into(),
                permissions: vec!["meters:read".into()],
            },
        )
        .await
        .unwrap();
    assert_eq!(key.permissions, ["meters:read"]);
    let revoked = admin.revoke_key(&store.id, &key.id).await.unwrap();
    assert!(revoked.revoked);
    let again = admin.revoke_key(&store.id, &key.id).await.unwrap_err();
    assert_eq!(again.code(), Some("api_key_revoked"));
    let wrong = Client::admin(&server.prod_url, "not-the-token")
        .create_store("x")
        .await
        .unwrap_err();
    assert_eq!(wrong.status(), Some(401));

    let tally = Client::new(&server.test_url, &store.api_keys.test);
    let customer = tally
        .create_customer(&CustomerCreate {
            email: "ada@example.com".into(),
            external_id: Some("ada".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(tally.get_customer(&customer.id).await.unwrap(), customer);
    let listed = tally
        .list_customers(&PageQuery {
            limit: Some(5),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.data, vec![customer.clone()]);
    assert!(!listed.has_more);

    let meter = tally
        .create_meter(&MeterCreate {
            name: "tokens".into(),
            event_name: "llm".into(),
            aggregation: "sum".into(),
            aggregation_property: Some("tokens".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(tally.get_meter(&meter.id).await.unwrap(), meter);
    let event = |id: &str, tokens: i64| EventInput {
        event_id: Some(id.into()),
        name: "llm".into(),
        customer_id: Some(customer.id.clone()),
        properties: Some([("tokens".to_string(), serde_json::json!(tokens))].into()),
        ..Default::default()
    };
    let result = tally
        .ingest(&IngestRequest {
            events: vec![event("e1", 5), event("e2", 7), event("e1", 9)],
        })
        .await
        .unwrap();
    assert_eq!((result.accepted, result.duplicates), (2, 1));
    let raw = serde_json::to_vec(&IngestRequest {
        events: vec![event("e3", 1)],
    })
    .unwrap();
    assert_eq!(tally.ingest_raw(raw).await.unwrap().accepted, 1);
    // Ingest answers once the batch is durable; aggregation follows (docs/api.md).
    server.engine.wait_caught_up().await.unwrap();
    assert_eq!(tally.get_event("e2").await.unwrap().properties["tokens"], 7);
    // The customer's usage of the meter, as the client reads it.
    let customer_usage = || async {
        tally
            .meter_usage(
                &meter.id,
                &UsageQuery {
                    customer_id: Some(customer.id.clone()),
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .value
    };
    assert_eq!(customer_usage().await.as_deref(), Some("13"));
    // A void through the client: e2 leaves the sum, and reads back voided.
    let voided = tally
        .void_events(&VoidRequest {
            event_ids: vec!["e2".into()],
            reason: "sent by mistake".into(),
        })
        .await
        .unwrap();
    assert_eq!(voided.voided, ["e2"]);
    let e2 = tally.get_event("e2").await.unwrap();
    assert!(e2.voided);
    assert_eq!(e2.void_reason.as_deref(), Some("sent by mistake"));
    assert_eq!(customer_usage().await.as_deref(), Some("6"));
    // An amendment: e3 (1 token) is replaced by e3b (4 tokens).
    let amended = tally
        .amend_event(
            "e3",
            &AmendRequest {
                event: EventChanges {
                    event_id: Some("e3b".into()),
                    properties: Some([("tokens".to_string(), serde_json::json!(4))].into()),
                    ..Default::default()
                },
                reason: "undercounted".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(amended.voided, "e3");
    assert_eq!(amended.replacement, tally.get_event("e3b").await.unwrap());
    assert_eq!(customer_usage().await.as_deref(), Some("9"));
    // A revision through the client: a dry run, then applied.
    let mut revision = MeterRevisionRequest {
        aggregation_property: Some(Some("cached_tokens".into())),
        dry_run: true,
        ..Default::default()
    };
    let dry = tally.revise_meter(&meter.id, &revision).await.unwrap();
    assert_eq!((dry.dry_run, dry.revision, dry.meter), (true, 2, None));
    assert_eq!(
        dry.changes,
        [RevisionChange {
            customer_id: customer.id.clone(),
            before: Some("9".into()),
            after: Some("0".into()),
        }]
    );
    revision.dry_run = false;
    let applied = tally.revise_meter(&meter.id, &revision).await.unwrap();
    assert_eq!(applied.changes, dry.changes);
    assert_eq!(
        applied.meter,
        Some(tally.get_meter(&meter.id).await.unwrap())
    );
    assert_eq!(tally.get_meter(&meter.id).await.unwrap().revision, 2);
    let invalid = tally
        .ingest(&IngestRequest {
            events: vec![EventInput {
                name: "llm".into(),
                ..Default::default()
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Some("invalid_usage_event"));
    assert_eq!(invalid.status(), Some(400));

    let hook = tally
        .create_webhook(&WebhookInput {
            delivery_mode: Some("cli".into()),
            events: Some(vec!["credits.granted".into()]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(hook.secret.is_some());
    let account = tally
        .create_account(&AccountCreate {
            customer_id: customer.id.clone(),
            initial_balance: Some("10".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(account.balance, "10");
    let movement = |amount: &str, key: &str| Movement {
        amount: amount.into(),
        idempotency_key: key.into(),
        ..Default::default()
    };
    let credit = tally
        .credit(&account.id, &movement("2.5", "c1"))
        .await
        .unwrap();
    assert_eq!(credit.r#type, "credit");
    tally
        .debit(&account.id, &movement("4", "d1"))
        .await
        .unwrap();
    let refused = tally
        .debit(&account.id, &movement("100", "d2"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some("insufficient_balance"));
    assert_eq!(tally.get_account(&account.id).await.unwrap().balance, "8.5");

    let pending = tally.pending_events(&hook.id, 10).await.unwrap();
    assert_eq!(pending.items.len(), 2, "initial balance and credit");
    let first = &pending.items[0];
    assert_eq!(first.event_type, "credits.granted");
    let attempt = tally.ack_event(&hook.id, &first.id, 200).await.unwrap();
    assert!(attempt.delivered);
    assert_eq!(
        tally
            .pending_events(&hook.id, 10)
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    let open = Client::anonymous(&server.test_url);
    assert_eq!(open.healthz().await.unwrap().status, "ok");
    assert_eq!(open.readyz().await.unwrap().status, "ready");
    assert_eq!(open.openapi().await.unwrap()["openapi"], "3.1.0");
    // Grants and reservations.
    let grant = tally
        .create_grant(
            &account.id,
            &GrantCreate {
                amount: "5".into(),
                idempotency_key: "g1".into(),
                priority: Some(10),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (grant.object.as_str(), grant.priority),
        ("credit_grant", 10)
    );
    let held = tally
        .reserve(
            &account.id,
            &ReservationCreate {
                amount: "3".into(),
                idempotency_key: "r1".into(),
                expires_in_seconds: Some(60),
            },
        )
        .await
        .unwrap();
    assert_eq!(held.status, "held");
    assert_eq!(
        tally
            .get_account(&account.id)
            .await
            .unwrap()
            .available_balance,
        "10.5"
    );
    let committed = tally.commit_reservation(&held.id, Some("2")).await.unwrap();
    assert_eq!(committed.status, "committed");
    assert!(committed.transaction_id.is_some());
    let other = tally
        .reserve(
            &account.id,
            &ReservationCreate {
                amount: "1".into(),
                idempotency_key: "r2".into(),
                expires_in_seconds: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        tally.release_reservation(&other.id).await.unwrap().status,
        "released"
    );
    let too_much = tally
        .reserve(
            &account.id,
            &ReservationCreate {
                amount: "100".into(),
                idempotency_key: "r3".into(),
                expires_in_seconds: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(too_much.code(), Some("insufficient_balance"));
    assert_eq!(
        tally.get_account(&account.id).await.unwrap().balance,
        "11.5"
    );

    server.stop().await;
}
