//! The store's behaviour through the public client, written once and run per
//! backend: `memory::`, `sqlite::` (a fresh file) and `postgres::` (a fresh
//! database on AGENTD_TEST_POSTGRES_URL).

mod log_capture;
mod prom;
mod store_wrap;
mod support;

use std::time::{Duration, SystemTime};

use agentd::domain::{RequestId, SessionId, TurnKey, UserId};
use agentd::pb;
use agentd::store::NewTurn;
use log_capture::Logs;
use support::*;
use tonic::{Code, Request};

const ORDER_Q: &str = "Where is order 1187?";

async fn sessions_are_listed_per_user_oldest_first_a_page_at_a_time(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let mut mine = Vec::new();
    for _ in 0..3 {
        mine.push(s.session(ALICE).await);
    }
    let bobs = s.session(BOB).await;
    let list = |token: String, size: u32, user: &'static str| {
        let mut c = s.raw();
        async move {
            c.list_sessions(pb::ListSessionsRequest {
                user_id: user.into(),
                page_size: size,
                page_token: token,
            })
            .await
            .map(|r| r.into_inner())
        }
    };
    let first = list(String::new(), 2, ALICE).await.unwrap();
    assert_eq!(first.sessions.len(), 2);
    assert!(!first.next_page_token.is_empty());
    let second = list(first.next_page_token.clone(), 2, ALICE).await.unwrap();
    assert!(
        second.next_page_token.is_empty(),
        "the last page has no token"
    );
    let listed: Vec<String> = first
        .sessions
        .iter()
        .chain(&second.sessions)
        .map(|x| x.session_id.clone())
        .collect();
    assert_eq!(listed, mine, "every session once, oldest first");
    let theirs = list(String::new(), 0, BOB).await.unwrap();
    assert_eq!(
        theirs
            .sessions
            .iter()
            .map(|x| x.session_id.clone())
            .collect::<Vec<_>>(),
        vec![bobs]
    );
    let bad = list("not-a-token".into(), 2, ALICE).await;
    assert_eq!(code(&bad), Code::InvalidArgument);
    s.stop().await;
}

/// One page of ALICE's session `sid` from GetSession.
async fn turn_page(
    s: &Server,
    sid: &str,
    token: String,
    size: u32,
    include_text: bool,
) -> Result<pb::SessionInfo, tonic::Status> {
    s.raw()
        .get_session(pb::GetSessionRequest {
            user_id: ALICE.into(),
            session_id: sid.into(),
            turn_page_size: size,
            turn_page_token: token,
            include_text,
        })
        .await
        .map(|r| r.into_inner())
}

/// GetSession returns a session's turns a page at a time, oldest first: the
/// pages together hold every turn once; a malformed page token is
/// INVALID_ARGUMENT. Listing does not read the questions.
async fn get_session_pages_through_every_turn_oldest_first(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(store.clone(), Opts::default()).await;
    let sid = s.session(ALICE).await;
    let rids: Vec<String> = (0..5).map(|i| format!("r{i}")).collect();
    for rid in &rids {
        let (_, end) = s.run(ALICE, &sid, rid, "hello").await;
        end.unwrap();
    }
    let page = |token: String, size: u32| turn_page(&s, &sid, token, size, false);
    let (mut seen, mut token, mut pages) = (Vec::new(), String::new(), 0);
    loop {
        let info = page(token, 2).await.unwrap();
        assert!(info.turns.len() <= 2);
        seen.extend(info.turns.iter().map(|t| t.request_id.clone()));
        pages += 1;
        token = info.next_turn_page_token;
        if token.is_empty() {
            break;
        }
        assert!(pages < 10, "the pages end");
    }
    assert_eq!(seen, rids);
    assert_eq!(pages, 3);
    // The default page holds them all.
    let all = page(String::new(), 0).await.unwrap();
    assert_eq!(all.turns.len(), 5);
    assert!(all.next_turn_page_token.is_empty());
    let bad = page("not-a-token".into(), 2).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("turn_page_token"), "{bad:?}");

    let listed = store
        .list_turns(SessionId::parse(&sid).unwrap(), None, 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 5);
    assert!(listed.iter().all(|t| t.user_text.is_empty()));
    s.stop().await;
}

/// GetSession with `include_text` returns each turn's question and final
/// answer (empty while it runs); without it, neither. Its pages hold at
/// most 50 turns and end after the turn that takes their text past 1 MiB;
/// together they hold every turn once, in order.
async fn get_session_with_text_returns_each_turns_question_and_answer_a_bounded_page_at_a_time(
    db: TestDb,
) {
    /// Counts the rows read with their text.
    #[derive(Default)]
    struct CountTexts(std::sync::atomic::AtomicUsize);
    #[async_trait::async_trait]
    impl store_wrap::Hooks for CountTexts {
        async fn list_turn_texts(
            &self,
            inner: &dyn agentd::store::Store,
            s: SessionId,
            after: Option<&agentd::store::TurnCursor>,
            limit: usize,
            bytes: usize,
        ) -> agentd::store::StoreResult<agentd::store::TurnTexts> {
            let read = inner.list_turn_texts(s, after, limit, bytes).await?;
            self.0
                .fetch_add(read.turns.len(), std::sync::atomic::Ordering::SeqCst);
            Ok(read)
        }
    }
    let counted = std::sync::Arc::new(CountTexts::default());
    let read = || counted.0.swap(0, std::sync::atomic::Ordering::SeqCst);
    let s = Server::start(
        std::sync::Arc::new(store_wrap::Wrapped {
            inner: db.open().await,
            hooks: counted.clone(),
        }),
        Opts {
            tool_delay: Duration::from_secs(30),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    // 20 turns of about 100 KB each (question and echoed answer).
    let big = |i: usize| format!("{i:02}{}", "q".repeat(50_000));
    let mut rids = Vec::new();
    for i in 0..20 {
        let rid = format!("e{i:02}");
        let (events, end) = run_agent(&s, &sid, &rid, "echo", &big(i)).await;
        end.unwrap();
        assert_eq!(events.last().unwrap().text, big(i));
        rids.push(rid);
    }
    let page = |token: String, size: u32, text: bool| turn_page(&s, &sid, token, size, text);
    let (mut seen, mut token, mut sizes) = (Vec::new(), String::new(), Vec::new());
    loop {
        let info = page(token, 0, true).await.unwrap();
        let texts: Vec<usize> = info
            .turns
            .iter()
            .map(|t| t.user_text.len() + t.answer.len() + t.answer_payload_json.len())
            .collect();
        let before_last: usize = texts[..texts.len() - 1].iter().sum();
        assert!(before_last < 1 << 20, "{texts:?}");
        sizes.push(texts.len());
        for t in &info.turns {
            let i: usize = t.request_id[1..].parse().unwrap();
            assert_eq!(
                (t.user_text.as_str(), t.answer.as_str()),
                (big(i).as_str(), big(i).as_str())
            );
            assert_eq!(t.state(), pb::TurnState::Completed);
        }
        seen.extend(info.turns.into_iter().map(|t| t.request_id));
        token = info.next_turn_page_token;
        if token.is_empty() {
            break;
        }
        assert!(sizes.len() < 20, "the pages end");
    }
    assert_eq!(seen, rids);
    assert_eq!(
        sizes,
        vec![11, 9],
        "100 KB a turn: ten under 1 MiB, and the one past it"
    );
    // At most 50 turns a page with text, whatever is asked; small turns.
    for i in 0..52 {
        let (_, end) = s.run(ALICE, &sid, &format!("s{i:02}"), "hello").await;
        end.unwrap();
    }
    read();
    let after_big = page(String::new(), 1000, true).await.unwrap();
    assert_eq!(after_big.turns.len(), 11);
    assert_eq!(
        read(),
        11,
        "only the page's turns are read with their text, not the 51 a page may take"
    );
    let small = page(after_big.next_turn_page_token.clone(), 1000, true)
        .await
        .unwrap();
    assert_eq!(small.turns.len(), 50);
    assert!(!small.next_turn_page_token.is_empty());
    assert!(
        small
            .turns
            .iter()
            .skip(9)
            .all(|t| t.user_text == "hello" && !t.answer.is_empty())
    );
    // Without include_text, no text, and the usual page.
    let plain = page(String::new(), 0, false).await.unwrap();
    assert_eq!(plain.turns.len(), 72);
    assert!(plain.turns.iter().all(|t| t.user_text.is_empty()
        && t.answer.is_empty()
        && t.answer_payload_json.is_empty()));
    // A running turn has its question and no answer yet.
    let mut running = s.client.clone();
    let req = run_request(ALICE, &sid, "slow", ORDER_Q);
    let call = tokio::spawn(async move { running.run_to_end(req, Duration::from_secs(60)).await });
    let mut last = None;
    for _ in 0..200 {
        let mut token = String::new();
        loop {
            let info = page(token, 0, true).await.unwrap();
            if let Some(t) = info.turns.iter().find(|t| t.request_id == "slow") {
                last = Some(t.clone());
            }
            token = info.next_turn_page_token;
            if token.is_empty() {
                break;
            }
        }
        if last.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let slow = last.expect("the running turn is listed");
    assert_eq!(slow.state(), pb::TurnState::Running);
    assert_eq!(
        (slow.user_text.as_str(), slow.answer.as_str()),
        (ORDER_Q, "")
    );
    call.abort();
    s.stop().await;
}

/// A page of turns with their text holds at most its limit, and no turn
/// after the one whose text (question, answer, in bytes, not characters)
/// takes the page to its bytes; `more` says whether a turn follows it. A
/// turn larger than the bytes is a page of its own; a running turn has its
/// question and no answer.
async fn a_page_of_turn_texts_is_cut_by_bytes_and_says_whether_more_follow(db: TestDb) {
    let store = db.open().await;
    let sid = alice_session(&*store).await.id;
    let key = move |r: &str| TurnKey {
        session_id: sid,
        request_id: RequestId::parse(r).unwrap(),
    };
    // Question 10 bytes; answers of 2-byte characters.
    let answers = [Some(20), Some(20), Some(100), None, Some(0)];
    for (i, answer) in answers.into_iter().enumerate() {
        let k = key(&format!("t{i}"));
        let claim = NewTurn {
            user_text: format!("question{i:02}"),
            ..new_turn(&k, "r1")
        };
        assert_eq!(
            store.claim_turn(&claim).await.unwrap(),
            agentd::store::Claim::New
        );
        // t3 stays running; t4 fails with no answer.
        match answer {
            Some(0) => end_turn(&*store, &k, None).await,
            Some(n) => end_turn(&*store, &k, Some(&"é".repeat(n))).await,
            None => {}
        }
        // Turns apart in time: the page's order is their claims'.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let page = |after: Option<&'static str>, limit: usize, bytes: usize| {
        let store = store.clone();
        async move {
            let cursor = match after {
                Some(r) => {
                    let t = store.get_turn(&key(r)).await.unwrap().unwrap();
                    Some(agentd::store::TurnCursor::after(&t))
                }
                None => None,
            };
            let page = store
                .list_turn_texts(sid, cursor.as_ref(), limit, bytes)
                .await
                .unwrap();
            let ids: Vec<String> = page
                .turns
                .iter()
                .map(|t| t.record.key.request_id.to_string())
                .collect();
            (ids, page.more, page.turns)
        }
    };
    // 50 bytes each (10 + 40): the second takes the page to 100 bytes.
    let (ids, more, turns) = page(None, 50, 100).await;
    assert_eq!((ids, more), (vec!["t0".to_owned(), "t1".to_owned()], true));
    assert_eq!(turns[0].record.user_text, "question00");
    assert_eq!(turns[1].answer, "é".repeat(20));
    assert_eq!(turns.iter().map(|t| t.text_bytes()).sum::<usize>(), 100);
    // One byte more, and the third (210 bytes) comes too, past the bytes.
    let (ids, more, _) = page(None, 50, 101).await;
    assert_eq!((ids.len(), more), (3, true));
    // A turn larger than the bytes alone.
    let (ids, more, turns) = page(Some("t1"), 50, 100).await;
    assert_eq!((ids, more), (vec!["t2".to_owned()], true));
    assert_eq!(turns[0].text_bytes(), 210);
    // The limit, then the end.
    let (ids, more, _) = page(Some("t2"), 1, 1000).await;
    assert_eq!((ids, more), (vec!["t3".to_owned()], true));
    let (ids, more, turns) = page(Some("t2"), 50, 1000).await;
    assert_eq!((ids, more), (vec!["t3".to_owned(), "t4".to_owned()], false));
    assert_eq!(
        (turns[0].record.state, turns[0].record.user_text.as_str()),
        (agentd::store::TurnState::Running, "question03")
    );
    assert_eq!(
        (turns[0].answer.as_str(), turns[1].answer.as_str()),
        ("", "")
    );
    let (ids, more, _) = page(Some("t4"), 50, 1000).await;
    assert_eq!((ids, more), (Vec::<String>::new(), false));
}

async fn get_session_lists_each_turn_with_its_final_status(db: TestDb) {
    let s = Server::start(
        db.open().await,
        Opts {
            tool_delay: Duration::from_secs(5),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let (_, ok) = s.run(ALICE, &sid, "r1", "hello").await;
    ok.unwrap();
    let late = s
        .client
        .clone()
        .run_to_end(
            run_request(ALICE, &sid, "r2", ORDER_Q),
            Duration::from_millis(200),
        )
        .await;
    let late = match late {
        Ok((_, r)) => r,
        Err(e) => Err(e),
    };
    assert_eq!(code(&late), Code::DeadlineExceeded);
    s.ended_turn(ALICE, &sid, "r2").await;
    let info = s.get_session(ALICE, &sid).await.unwrap();
    assert_eq!(info.user_id, ALICE);
    assert_eq!(info.session_id, sid);
    let turns: Vec<(String, pb::TurnState, Option<i32>)> = info
        .turns
        .iter()
        .map(|t| (t.request_id.clone(), t.state(), t.status_code))
        .collect();
    assert_eq!(
        turns,
        vec![
            ("r1".into(), pb::TurnState::Completed, Some(0)),
            (
                "r2".into(),
                pb::TurnState::DeadlineExceeded,
                Some(Code::DeadlineExceeded as i32)
            ),
        ]
    );
    assert!(
        info.turns
            .iter()
            .all(|t| t.owner == "replica-a" && t.agent == "order_helper")
    );
    s.stop().await;
}

async fn a_foreign_or_unknown_session_is_not_found_on_every_call(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    s.run(ALICE, &sid, "r1", "hello").await.1.unwrap();
    let unknown = SessionId::generate().to_string();
    for (user, session) in [(BOB, sid.as_str()), (ALICE, unknown.as_str())] {
        assert_eq!(code(&s.get_session(user, session).await), Code::NotFound);
        assert_eq!(
            code(&s.attach(user, session, "r1", None).await),
            Code::NotFound
        );
        let del = s
            .raw()
            .delete_session(pb::DeleteSessionRequest {
                user_id: user.into(),
                session_id: session.into(),
            })
            .await;
        assert_eq!(code(&del), Code::NotFound);
        let run = s
            .client
            .clone()
            .run(
                run_request(user, session, "r2", "hello"),
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(code(&run.map(|_| ())), Code::NotFound);
    }
    assert_eq!(
        s.get_session(ALICE, &sid).await.unwrap().turns.len(),
        1,
        "nothing changed"
    );
    s.stop().await;
}

async fn a_repeated_request_id_replays_the_stored_turn_without_running_the_tool_again(db: TestDb) {
    let s = Server::start(
        db.open().await,
        Opts {
            tool_delay: Duration::from_millis(100),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let (first, ok) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    ok.unwrap();
    assert_eq!(seqs(&first), vec![0, 1, 2]);
    let (again, ok) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    ok.unwrap();
    assert_eq!(
        again, first,
        "same events, same seq, same text and timestamps"
    );
    // Two racing calls with a new request id: one runs, one attaches.
    let (a, b) = tokio::join!(
        s.run(ALICE, &sid, "r2", ORDER_Q),
        s.run(ALICE, &sid, "r2", ORDER_Q)
    );
    a.1.unwrap();
    b.1.unwrap();
    assert_eq!(a.0, b.0);
    assert_eq!(s.stats.started(), 2, "one tool run per request id");
    s.stop().await;
}

async fn a_follow_up_turn_remembers_the_order_from_the_stored_history(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    s.run(ALICE, &sid, "r1", "Where is order 2301?")
        .await
        .1
        .unwrap();
    let (events, ok) = s.run(ALICE, &sid, "r2", "and when will it arrive?").await;
    ok.unwrap();
    let answer = &events.last().unwrap().text;
    assert!(answer.contains("2301"), "{answer}");
    s.stop().await;
}

async fn attach_after_a_seq_streams_the_rest_then_the_final_status(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    let (all, ok) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    ok.unwrap();
    let (rest, ok) = s.attach(ALICE, &sid, "r1", Some(0)).await.unwrap();
    ok.unwrap();
    assert_eq!(rest, all[1..]);
    let (from_start, ok) = s.attach(ALICE, &sid, "r1", None).await.unwrap();
    ok.unwrap();
    assert_eq!(from_start, all);
    let (none, ok) = s.attach(ALICE, &sid, "r1", Some(2)).await.unwrap();
    ok.unwrap();
    assert!(none.is_empty());
    // A seq past what the store's integers hold is refused, not read as
    // "from the start".
    let huge = s.attach(ALICE, &sid, "r1", Some(u64::MAX)).await;
    assert_eq!(code(&huge), Code::InvalidArgument);
    assert!(
        huge.unwrap_err()
            .message()
            .contains("after_seq must be at most"),
        "says which field"
    );
    let (last, ok) = s
        .attach(ALICE, &sid, "r1", Some(i64::MAX as u64))
        .await
        .unwrap();
    ok.unwrap();
    assert!(last.is_empty(), "nothing stored after the largest seq");
    assert_eq!(
        code(&s.attach(ALICE, &sid, "nope", None).await),
        Code::NotFound
    );
    assert_eq!(s.stats.started(), 1);
    s.stop().await;
}

async fn a_continued_run_outlives_its_client_and_can_be_attached_later(db: TestDb) {
    let s = Server::start(
        db.open().await,
        Opts {
            tool_delay: Duration::from_millis(300),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let mut req = run_request(ALICE, &sid, "r1", ORDER_Q);
    req.on_disconnect = pb::OnDisconnect::Continue as i32;
    let mut call = s
        .client
        .clone()
        .run(req, Duration::from_secs(30))
        .await
        .unwrap();
    let first = call.events.message().await.unwrap().unwrap();
    assert_eq!(first.seq, 0);
    drop(call);
    let (rest, ok) = s.attach(ALICE, &sid, "r1", Some(0)).await.unwrap();
    ok.unwrap();
    assert_eq!(seqs(&rest), vec![1, 2]);
    assert!(rest[1].is_final);
    assert_eq!(
        (s.stats.completed(), s.stats.cancelled()),
        (1, 0),
        "the tool ran to its end"
    );
    assert_eq!(
        s.ended_turn(ALICE, &sid, "r1").await.state(),
        pb::TurnState::Completed
    );
    s.stop().await;
}

async fn a_run_whose_client_leaves_is_cancelled_by_default_and_replays_cancelled(db: TestDb) {
    let s = Server::start(
        db.open().await,
        Opts {
            tool_delay: Duration::from_secs(20),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let mut call = s
        .client
        .clone()
        .run(
            run_request(ALICE, &sid, "r1", ORDER_Q),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    drop(call);
    let turn = s.ended_turn(ALICE, &sid, "r1").await;
    assert_eq!(
        (turn.state(), turn.status_code),
        (pb::TurnState::Cancelled, Some(Code::Cancelled as i32))
    );
    assert_eq!(s.stats.cancelled(), 1);
    let (events, end) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    assert_eq!(seqs(&events), vec![0]);
    assert_eq!(code(&end), Code::Cancelled);
    assert_eq!(s.stats.started(), 1);
    s.stop().await;
}

/// The event log of turn `rid` of session `sid` is gone from the store.
async fn assert_log_gone(store: &dyn agentd::store::Store, sid: &str, rid: &str) {
    let key = TurnKey {
        session_id: SessionId::parse(sid).unwrap(),
        request_id: RequestId::parse(rid).unwrap(),
    };
    assert!(
        store.events_after(&key, None, 10).await.unwrap().is_empty(),
        "its event log went too"
    );
}

async fn delete_session_removes_it_with_its_turns_but_not_while_a_turn_runs(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(
        store.clone(),
        Opts {
            tool_delay: Duration::from_millis(500),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let del = || {
        let mut c = s.raw();
        let sid = sid.clone();
        async move {
            c.delete_session(pb::DeleteSessionRequest {
                user_id: ALICE.into(),
                session_id: sid,
            })
            .await
        }
    };
    let mut call = s
        .client
        .clone()
        .run(
            run_request(ALICE, &sid, "r1", ORDER_Q),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    assert_eq!(code(&del().await), Code::FailedPrecondition);
    assert_eq!(
        collect(&mut call.events).await.1.map_err(|s| s.code()),
        Ok(())
    );
    s.ended_turn(ALICE, &sid, "r1").await;
    del().await.unwrap();
    assert_eq!(code(&s.get_session(ALICE, &sid).await), Code::NotFound);
    assert_log_gone(&*store, &sid, "r1").await;
    assert_eq!(
        code(&s.attach(ALICE, &sid, "r1", None).await),
        Code::NotFound
    );
    let listed = s
        .raw()
        .list_sessions(pb::ListSessionsRequest {
            user_id: ALICE.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(listed.into_inner().sessions.is_empty());
    s.stop().await;
}

/// A replica whose lease on a running turn lapsed (a store stall, a clock
/// jump) and whose turn another replica marked failed stops running it at
/// its next renewal: its caller gets the recorded UNAVAILABLE, as every
/// replay does, instead of the run going on unseen.
async fn a_run_whose_lease_was_lost_stops_and_ends_as_recorded(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(
        store.clone(),
        Opts {
            lease: Duration::from_millis(600),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let req = pb::RunRequest {
        agent: "stream".into(),
        ..run_request(ALICE, &sid, "r1", "n=2000 size=8 rate=100")
    };
    let mut call = s
        .client
        .clone()
        .run(req, Duration::from_secs(30))
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    // The lease lapses, and another replica's sweep finds it so.
    let key = TurnKey {
        session_id: SessionId::parse(&sid).unwrap(),
        request_id: RequestId::parse("r1").unwrap(),
    };
    lapse_and_sweep(&*store, &key).await;
    let started = std::time::Instant::now();
    let (events, end) = collect(&mut call.events).await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("replica stopped"), "{status:?}");
    assert!(
        events.len() < 1000,
        "the run stopped at its next renewal, not at its end: {} events",
        events.len()
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    let (_, replayed) = s.attach(ALICE, &sid, "r1", None).await.unwrap();
    assert_eq!(replayed.unwrap_err().code(), Code::Unavailable);
    s.stop().await;
}

/// A running turn's lease made to lapse, as a replica's late renewals let
/// it, then found so by a sweep (another replica's, say). Leases are judged
/// by the store's clock alone, so the lease is ended through its owner
/// (renewed for no time); tried again if the owner's own renewal came in
/// between. The server's own sweep may find the lapsed lease first: the
/// turn is then failed as the test's sweep would have failed it.
async fn lapse_and_sweep(store: &dyn agentd::store::Store, key: &TurnKey) {
    let stopped = agentd::grpc::status::replica_stopped();
    eventually("the turn's lease lapsed and swept", || async {
        let turn = store.get_turn(key).await.unwrap().unwrap();
        if turn.state != agentd::store::TurnState::Running {
            assert_eq!(turn.outcome.as_ref(), Some(&stopped), "{turn:?}");
            return Some(());
        }
        if !store
            .renew_lease(key, &turn.owner, Duration::ZERO)
            .await
            .unwrap()
        {
            // Swept (or ended) since it was read: read again.
            return None;
        }
        lapse().await;
        let swept = store.fail_expired(&stopped).await.unwrap();
        (swept == [key.clone()]).then_some(())
    })
    .await;
}

/// A run whose task dies (an agent's panic) ends INTERNAL for its caller,
/// as it is recorded, never as a clean end of the stream.
async fn a_run_whose_task_panics_ends_internal_not_ok(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    let req = pb::RunRequest {
        agent: "panics".into(),
        ..run_request(ALICE, &sid, "r1", "go")
    };
    let (events, end) = s
        .client
        .clone()
        .run_to_end(req, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(events.len(), 1);
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    let replayed = eventually("the outcome to be recorded", || async {
        let (_, end) = s.attach(ALICE, &sid, "r1", None).await.ok()?;
        end.err().filter(|st| st.code() == Code::Internal)
    })
    .await;
    assert_eq!(replayed.message(), status.message(), "replayed as it ended");
    s.stop().await;
}

/// A Run admitted just before shutdown began, still waiting for its claim,
/// is in flight for the drain: it gets the grace and finishes, instead of
/// the server exiting under it.
/// (On the SQL stores, whose writes a test can hold.)
async fn a_run_admitted_as_the_drain_begins_gets_the_grace(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    let held = db.hold_writes().await;
    let run = tokio::spawn({
        let mut c = s.client.clone();
        let req = run_request(ALICE, &sid, "r1", ORDER_Q);
        async move { c.run_to_end(req, Duration::from_secs(30)).await }
    });
    eventually("the Run to be admitted", || async {
        (s.turns.in_flight() == 1).then_some(())
    })
    .await;
    let turns = s.turns.clone();
    let stopping = tokio::spawn(s.stop());
    eventually("the drain to begin", || async {
        turns.is_draining().then_some(())
    })
    .await;
    held.release().await;
    let (events, end) = run.await.unwrap().unwrap();
    end.unwrap();
    assert_eq!(events.len(), 3);
    stopping.await.unwrap();
}

async fn a_turn_whose_replica_stopped_renewing_its_lease_ends_unavailable_and_is_never_run(
    db: TestDb,
) {
    let store = db.open().await;
    let s = Server::start(store.clone(), Opts::default()).await;
    let sid = s.session(ALICE).await;
    // A replica that claimed the turn, then died: its lease runs out.
    let key = TurnKey {
        session_id: SessionId::parse(&sid).unwrap(),
        request_id: RequestId::parse("r1").unwrap(),
    };
    let claim = NewTurn {
        key: key.clone(),
        user_text: ORDER_Q.into(),
        agent: "order_helper".into(),
        owner: "replica-that-died".into(),
        lease: Duration::from_millis(300),
    };
    assert_eq!(
        store.claim_turn(&claim).await.unwrap(),
        agentd::store::Claim::New
    );
    let (events, end) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    assert!(events.is_empty());
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("serving replica stopped"),
        "{}",
        status.message()
    );
    assert_eq!(s.stats.started(), 0, "never re-run");
    let again = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    assert_eq!(
        code(&again.1),
        Code::Unavailable,
        "a definite answer, every time"
    );
    assert_eq!(s.stats.started(), 0);
    s.stop().await;
}

async fn finished_turns_are_pruned_after_the_retention(db: TestDb) {
    let store = db.open().await;
    let opts = Opts {
        retain_turns: Some(Duration::from_millis(300)),
        ..Opts::default()
    };
    let s = Server::start(store.clone(), opts).await;
    let sid = s.session(ALICE).await;
    let tasks = store.a2a_tasks();
    tasks
        .create_for(
            &UserId::parse(ALICE).unwrap(),
            a2a_task("t1", a2a::TaskState::Completed),
        )
        .await
        .unwrap();
    s.run(ALICE, &sid, "r1", ORDER_Q).await.1.unwrap();
    assert_eq!(s.get_session(ALICE, &sid).await.unwrap().turns.len(), 1);
    if !matches!(db.backend, Backend::Memory) {
        eventually("the ended A2A task to be pruned", || async {
            tasks.get("t1").await.unwrap().is_none().then_some(())
        })
        .await;
    }
    eventually("the turn to be pruned", || async {
        s.get_session(ALICE, &sid)
            .await
            .unwrap()
            .turns
            .is_empty()
            .then_some(())
    })
    .await;
    assert_log_gone(&*store, &sid, "r1").await;
    assert!(
        s.get_session(ALICE, &sid).await.is_ok(),
        "the session stays"
    );
    s.stop().await;
}

async fn bad_input_to_the_session_calls_is_invalid_argument_and_changes_nothing(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    assert_eq!(
        code(&s.get_session(ALICE, "not-a-uuid").await),
        Code::InvalidArgument
    );
    assert_eq!(code(&s.get_session("", &sid).await), Code::InvalidArgument);
    assert_eq!(
        code(&s.attach(ALICE, &sid, "bad id with spaces", None).await),
        Code::InvalidArgument
    );
    let listed = s
        .raw()
        .list_sessions(pb::ListSessionsRequest {
            user_id: String::new(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&listed), Code::InvalidArgument);
    let mut req = run_request(ALICE, &sid, "r1", ORDER_Q);
    req.on_disconnect = 99;
    let mut r = Request::new(req);
    r.set_timeout(Duration::from_secs(5));
    let run = s.raw().run(r).await;
    let status = run.map(|_| ()).unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("on_disconnect"),
        "{}",
        status.message()
    );
    assert!(
        s.get_session(ALICE, &sid).await.unwrap().turns.is_empty(),
        "nothing stored"
    );
    s.stop().await;
}

/// A CreateSession repeated with its request id answers the session the
/// first one made, also when the repeats race; another user's or another
/// key's is a session of its own; a key whose session was deleted makes a
/// new one; no key, a new session each time; a malformed key is
/// INVALID_ARGUMENT and makes nothing.
async fn a_create_session_repeated_with_its_request_id_answers_the_session_it_made(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(store.clone(), Opts::default()).await;
    let create = |user: &str, key: &str| {
        let mut c = s.raw();
        let req = pb::CreateSessionRequest {
            user_id: user.into(),
            request_id: key.into(),
        };
        async move {
            c.create_session(req)
                .await
                .map(|r| r.into_inner().session_id)
        }
    };
    let first = create(ALICE, "c1").await.unwrap();
    assert_eq!(create(ALICE, "c1").await.unwrap(), first);
    let racing: Vec<String> = futures::future::join_all((0..8).map(|_| create(ALICE, "race")))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(racing.iter().all(|id| *id == racing[0]), "{racing:?}");
    assert_ne!(racing[0], first);
    let bobs = create("bob", "c1").await.unwrap();
    assert_ne!(bobs, first, "a key is its user's");
    let unkeyed = (
        create(ALICE, "").await.unwrap(),
        create(ALICE, "").await.unwrap(),
    );
    assert_ne!(unkeyed.0, unkeyed.1);
    let listed = |user: &str| {
        let mut c = s.raw();
        let req = pb::ListSessionsRequest {
            user_id: user.into(),
            ..Default::default()
        };
        async move {
            c.list_sessions(req)
                .await
                .unwrap()
                .into_inner()
                .sessions
                .len()
        }
    };
    assert_eq!(listed(ALICE).await, 4, "c1, race and two without a key");
    for bad in ["has spaces", &"k".repeat(200)] {
        let status = create(ALICE, bad).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("request_id"), "{status:?}");
    }
    assert_eq!(listed(ALICE).await, 4, "nothing made by bad input");
    // Deleted, the key makes a new session.
    s.raw()
        .delete_session(pb::DeleteSessionRequest {
            user_id: ALICE.into(),
            session_id: first.clone(),
        })
        .await
        .unwrap();
    let again = create(ALICE, "c1").await.unwrap();
    assert_ne!(again, first);
    assert_eq!(create(ALICE, "c1").await.unwrap(), again);
    // The store tells a session it made from one it found.
    let (alice, key) = (
        UserId::parse(ALICE).unwrap(),
        RequestId::parse("direct").unwrap(),
    );
    let made = store.create_session_keyed(&alice, &key).await.unwrap();
    let found = store.create_session_keyed(&alice, &key).await.unwrap();
    assert!(made.created && !found.created);
    assert_eq!(made.session, found.session);
    s.stop().await;
}

/// Text with U+0000 in it: refused as a question (PostgreSQL's text cannot
/// hold it, so no store is asked to); in an agent's answer, streamed and
/// replayed as sent and kept in the history with U+FFFD in its place.
async fn a_nul_character_is_refused_in_a_question_and_kept_out_of_the_stored_history(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(store.clone(), Opts::default()).await;
    let sid = s.session(ALICE).await;
    let status = s
        .client
        .clone()
        .run_to_end(
            run_request(ALICE, &sid, "q", "where\0is it?"),
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("NUL"), "{}", status.message());
    assert!(
        s.get_session(ALICE, &sid).await.unwrap().turns.is_empty(),
        "nothing stored"
    );

    let req = agentd::pb::RunRequest {
        agent: "nul_answer".into(),
        ..run_request(ALICE, &sid, "r1", "answer with a NUL")
    };
    let (live, ok) = s
        .client
        .clone()
        .run_to_end(req, Duration::from_secs(30))
        .await
        .unwrap();
    ok.unwrap();
    assert_eq!(live.last().unwrap().text, NUL_ANSWER, "streamed as sent");
    let (replayed, ok) = s.attach(ALICE, &sid, "r1", None).await.unwrap();
    ok.unwrap();
    assert_eq!(replayed, live, "replayed as sent");
    let history = store
        .history(SessionId::parse(&sid).unwrap(), 5)
        .await
        .unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].answer, "before\u{FFFD}after");
    s.stop().await;
}

/// A Run of agent `agent`, collected to its end.
async fn run_agent(
    s: &Server,
    sid: &str,
    rid: &str,
    agent: &str,
    text: &str,
) -> (Vec<pb::AgentEvent>, Result<(), tonic::Status>) {
    let req = pb::RunRequest {
        agent: agent.into(),
        ..run_request(ALICE, sid, rid, text)
    };
    s.client
        .clone()
        .run_to_end(req, Duration::from_secs(30))
        .await
        .unwrap()
}

/// A completed turn's final answer payload (its FINAL_ANSWER event's
/// `payload_json`, which the client sees) and the agent that ran it come
/// back in the history of the session's later runs, whatever agents ran in
/// between; from the database as from the SQLite store's memory, and
/// after the store is opened again. A payload over the bound reaches the
/// client and the event log but is not kept beside the turn.
async fn a_final_answers_payload_and_agent_come_back_in_the_next_runs_history(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(store.clone(), Opts::default()).await;
    let sid = s.session(ALICE).await;
    let (events, ok) = run_agent(&s, &sid, "r1", "notes", "first").await;
    ok.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind(), pb::EventKind::FinalAnswer);
    assert_eq!(
        last.payload_json, r#"{"note":"first"}"#,
        "the client sees it"
    );
    run_agent(&s, &sid, "r2", "echo", "hello").await.1.unwrap();
    let (events, ok) = run_agent(&s, &sid, "r3", "notes", "big").await;
    ok.unwrap();
    let big = &events.last().unwrap().payload_json;
    assert!(
        big.len() > agentd::agent::MAX_ANSWER_PAYLOAD_BYTES,
        "{} bytes",
        big.len()
    );
    let (replayed, ok) = s.attach(ALICE, &sid, "r3", None).await.unwrap();
    ok.unwrap();
    assert_eq!(
        &replayed.last().unwrap().payload_json,
        big,
        "the event log keeps it whole"
    );
    let seen = [
        r#"r1 notes {"note":"first"}"#,
        "r2 echo ",
        // Over the bound: not kept.
        "r3 notes ",
    ];
    let (events, ok) = run_agent(&s, &sid, "r4", "notes", "again").await;
    ok.unwrap();
    assert_eq!(events.last().unwrap().text, seen.join("\n"));
    // The history a Run reads (on SQLite from memory) is the database's.
    let id = SessionId::parse(&sid).unwrap();
    let (_, read) = store.session_with_history(id, 10).await.unwrap().unwrap();
    let stored = store.history(id, 10).await.unwrap();
    assert_eq!(read, stored);
    let kept: Vec<(&str, &str)> = stored
        .iter()
        .map(|t| (t.agent.as_str(), t.answer_payload.as_str()))
        .collect();
    assert_eq!(
        kept,
        [
            ("notes", r#"{"note":"first"}"#),
            ("echo", ""),
            ("notes", ""),
            ("notes", r#"{"note":"again"}"#),
        ]
    );
    s.stop().await;
    drop(store);
    if db.backend == Backend::Memory {
        return;
    }
    // Opened again (on SQLite, the file without the memory of it).
    let s = Server::start(db.open().await, Opts::default()).await;
    let (events, ok) = run_agent(&s, &sid, "r5", "notes", "after").await;
    ok.unwrap();
    let mut after = seen.to_vec();
    after.push(r#"r4 notes {"note":"again"}"#);
    assert_eq!(events.last().unwrap().text, after.join("\n"));
    s.stop().await;
}

/// The store contract below the service: a claim is exclusive, appends keep
/// seq order, and a lease is only renewed by its owner.
async fn the_turn_claim_is_exclusive_and_leases_belong_to_their_owner(db: TestDb) {
    let store = db.open().await;
    let session = alice_session(&*store).await;
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    let claim = |owner: &str| NewTurn {
        key: key.clone(),
        user_text: "hi".into(),
        agent: "echo".into(),
        owner: owner.into(),
        lease: Duration::from_secs(5),
    };
    let claims = futures::future::join_all((0..8).map(|i| {
        let store = store.clone();
        let c = claim(&format!("r{i}"));
        async move { store.claim_turn(&c).await.unwrap() }
    }))
    .await;
    let winners = claims
        .iter()
        .filter(|c| **c == agentd::store::Claim::New)
        .count();
    assert_eq!(winners, 1, "exactly one claim wins");
    let owner = store.get_turn(&key).await.unwrap().unwrap().owner;
    let minute = Duration::from_secs(60);
    assert!(store.renew_lease(&key, &owner, minute).await.unwrap());
    assert!(
        !store
            .renew_lease(&key, "someone-else", Duration::ZERO)
            .await
            .unwrap()
    );
    let rec = store.get_turn(&key).await.unwrap().unwrap();
    assert!(rec.lease_expires_at > SystemTime::now() + Duration::from_secs(50));
    let outcome = agentd::grpc::status::replica_stopped();
    assert_eq!(
        store.fail_expired(&outcome).await.unwrap(),
        Vec::<TurnKey>::new(),
        "a live lease is left alone"
    );
    // Renewed for no time, the lease runs out.
    assert!(
        store
            .renew_lease(&key, &owner, Duration::ZERO)
            .await
            .unwrap()
    );
    lapse().await;
    assert_eq!(
        store.fail_expired(&outcome).await.unwrap(),
        vec![key.clone()],
        "the turn it failed, named"
    );
    assert_eq!(
        store.get_turn(&key).await.unwrap().unwrap().outcome,
        Some(outcome)
    );
    assert!(
        !store.renew_lease(&key, &owner, minute).await.unwrap(),
        "a failed turn is not renewed"
    );
    store.ping().await.unwrap();
}

async fn the_event_log_reads_back_in_seq_order_across_commits_of_any_size(db: TestDb) {
    use agentd::agent::{Event, EventKind};
    use agentd::store::{SeqEvent, TurnOutcome, TurnState};
    let store = db.open().await;
    let session = alice_session(&*store).await;
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    store
        .claim_turn(&NewTurn {
            key: key.clone(),
            user_text: "hi".into(),
            agent: "echo".into(),
            owner: "replica-a".into(),
            lease: Duration::from_secs(5),
        })
        .await
        .unwrap();
    let event = |seq: u64, kind: EventKind, text: String| SeqEvent {
        seq,
        event: Event {
            kind,
            author: "echo".into(),
            text,
            tool_name: String::new(),
            tool_call_id: String::new(),
            payload_json: String::new(),
            created_unix_nanos: seq as i64,
        },
    };
    // Commits of 1, 7, 300 and 2 events; one holds a 1.5 MiB event between
    // small ones, larger than a stored batch row.
    let mut all = Vec::new();
    let mut seq = 0;
    for size in [1usize, 7, 300, 2] {
        let batch: Vec<SeqEvent> = (0..size)
            .map(|i| {
                let text = if size == 7 && i == 3 {
                    "x".repeat(3 << 19)
                } else {
                    format!("chunk {seq}")
                };
                let kind = if seq == 309 {
                    EventKind::FinalAnswer
                } else {
                    EventKind::PartialText
                };
                seq += 1;
                event(seq - 1, kind, text)
            })
            .collect();
        all.extend(batch.clone());
        store.append_events(&key, batch).await.unwrap();
    }
    assert_eq!(all.len(), 310);
    assert_eq!(store.events_after(&key, None, 1000).await.unwrap(), all);
    for (after, limit) in [
        (None, 1),
        (Some(0), 5),
        (Some(4), 100),
        (Some(9), 3),
        (Some(305), 10),
        (Some(309), 10),
    ] {
        let from = after.map_or(0, |a| a as usize + 1);
        let want: Vec<_> = all.iter().skip(from).take(limit).cloned().collect();
        assert_eq!(
            store.events_after(&key, after, limit).await.unwrap(),
            want,
            "after {after:?}, limit {limit}"
        );
    }
    store
        .finish_turn(
            &key,
            &TurnOutcome {
                state: TurnState::Completed,
                code: 0,
                message: String::new(),
            },
            Some("chunk 309".into()),
        )
        .await
        .unwrap();
    let history = store.history(session.id, 10).await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(
        history[0].answer, "chunk 309",
        "the final answer is the turn's memory"
    );
    assert_eq!(
        store.events_after(&key, Some(308), 10).await.unwrap()[0]
            .event
            .kind,
        EventKind::FinalAnswer
    );
}

/// Many turns append at once (a store commits them together) and one append
/// names a turn that was never claimed: that one fails, alone, and every
/// other turn's events are stored in order.
async fn appends_of_many_turns_at_once_are_all_stored_and_a_bad_one_fails_alone(db: TestDb) {
    use agentd::agent::{Event, EventKind};
    use agentd::store::SeqEvent;
    let store = db.open().await;
    let session = alice_session(&*store).await;
    let key = |r: String| TurnKey {
        session_id: session.id,
        request_id: RequestId::parse(r).unwrap(),
    };
    let keys: Vec<TurnKey> = (0..32).map(|i| key(format!("r{i}"))).collect();
    for k in &keys {
        store
            .claim_turn(&NewTurn {
                key: k.clone(),
                user_text: "hi".into(),
                agent: "echo".into(),
                owner: "replica-a".into(),
                lease: Duration::from_secs(30),
            })
            .await
            .unwrap();
    }
    let events = |k: &TurnKey, from: u64| -> Vec<SeqEvent> {
        (from..from + 10)
            .map(|seq| SeqEvent {
                seq,
                event: Event {
                    kind: EventKind::PartialText,
                    author: "echo".into(),
                    text: format!("{} {seq}", k.request_id),
                    tool_name: String::new(),
                    tool_call_id: String::new(),
                    payload_json: String::new(),
                    created_unix_nanos: 1,
                },
            })
            .collect()
    };
    let unclaimed = key("never-claimed".into());
    for round in 0..3u64 {
        let good = futures::future::join_all(
            keys.iter()
                .map(|k| store.append_events(k, events(k, round * 10))),
        );
        let bad = store.append_events(&unclaimed, events(&unclaimed, round * 10));
        let (good, bad) = tokio::join!(good, bad);
        assert!(bad.is_err(), "an append to an unclaimed turn is refused");
        for r in good {
            r.unwrap();
        }
    }
    for k in &keys {
        let want: Vec<SeqEvent> = (0..3).flat_map(|round| events(k, round * 10)).collect();
        assert_eq!(store.events_after(k, None, 100).await.unwrap(), want, "{k}");
    }
}

/// Waits (bounded) until a statement of this database waits for a lock.
async fn a_statement_waits_for_a_lock(watcher: &sqlx::PgPool, what: &str) {
    eventually(what, || {
        let watcher = watcher.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&watcher)
            .await
            .unwrap();
            (waiting > 0).then_some(())
        }
    })
    .await;
}

/// The store never deletes a session under a running turn: checked in the
/// delete's own transaction, so on PostgreSQL a claim in flight when the
/// delete starts (inserted by another replica, not yet committed) is waited
/// for and seen.
async fn a_session_is_not_deleted_under_a_running_turn_even_one_claimed_during_the_delete(
    db: TestDb,
) {
    use agentd::store::Deletion;
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap();
    let k = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    store.claim_turn(&new_turn(&k, "replica-a")).await.unwrap();
    assert_eq!(
        store.delete_session(session.id).await.unwrap(),
        Deletion::Busy
    );
    assert!(store.get_session(session.id).await.unwrap().is_some());
    assert!(
        store.get_turn(&k).await.unwrap().is_some(),
        "its turn stays"
    );
    end_turn(&*store, &k, Some("done")).await;
    assert_eq!(
        store.delete_session(session.id).await.unwrap(),
        Deletion::Deleted
    );
    assert_eq!(
        store.delete_session(session.id).await.unwrap(),
        Deletion::NotFound
    );

    if db.backend != Backend::Postgres {
        return;
    }
    use sqlx::Connection as _;
    let other = store.create_session(&alice).await.unwrap();
    let mut claimer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut claim = claimer.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO turns (session_id, request_id, user_text, agent, state, owner, lease_expires_at, created_at, updated_at) \
         VALUES ($1, 'r2', 'q', 'order_helper', 'running', 'replica-b', 0, 0, 0)",
    )
    .bind(other.id.to_string())
    .execute(&mut *claim)
    .await
    .unwrap();
    let delete = tokio::spawn({
        let store = store.clone();
        async move { store.delete_session(other.id).await }
    });
    let watcher = sqlx::PgPool::connect(&db.url).await.unwrap();
    a_statement_waits_for_a_lock(&watcher, "the delete waits for the claim's lock").await;
    claim.commit().await.unwrap();
    assert_eq!(delete.await.unwrap().unwrap(), Deletion::Busy);
    assert!(store.get_session(other.id).await.unwrap().is_some());

    // The other order: a Run reads its session, then its claim waits for a
    // delete that commits first. It is told the session is gone.
    let s = Server::start(store.clone(), Opts::default()).await;
    let sid = s.session(ALICE).await;
    let mut deleter = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut deleting = deleter.begin().await.unwrap();
    sqlx::query("DELETE FROM sessions WHERE id = $1")
        .bind(&sid)
        .execute(&mut *deleting)
        .await
        .unwrap();
    let run = tokio::spawn({
        let mut c = s.client.clone();
        let req = run_request(ALICE, &sid, "r3", ORDER_Q);
        async move { c.run_to_end(req, Duration::from_secs(30)).await }
    });
    a_statement_waits_for_a_lock(&watcher, "the claim waits for the delete's lock").await;
    deleting.commit().await.unwrap();
    let status = match run.await.unwrap() {
        Err(status) | Ok((_, Err(status))) => status,
        Ok(ok) => panic!("ran in a deleted session: {ok:?}"),
    };
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    s.stop().await;
}

/// A new session of alice's, made on the store itself.
async fn alice_session(store: &dyn agentd::store::Store) -> agentd::store::Session {
    store
        .create_session(&UserId::parse(ALICE).unwrap())
        .await
        .unwrap()
}

fn new_turn(key: &TurnKey, owner: &str) -> NewTurn {
    NewTurn {
        key: key.clone(),
        user_text: format!("question {}", key.request_id),
        agent: "echo".into(),
        owner: owner.into(),
        lease: Duration::from_secs(30),
    }
}

/// Turns starting together are claimed together (the SQL stores write the
/// claims queued at one moment in one statement): each key is claimed once
/// whoever races for it, even twice in one group; a claim in a session that
/// does not exist fails alone; and every claimed turn marks its session
/// updated.
async fn claims_made_together_each_win_once_and_a_bad_one_fails_alone(db: TestDb) {
    use agentd::store::Claim;
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let sessions = [
        store.create_session(&alice).await.unwrap(),
        store.create_session(&alice).await.unwrap(),
    ];
    let keys: Vec<TurnKey> = (0..24)
        .map(|i| TurnKey {
            session_id: sessions[i % 2].id,
            request_id: RequestId::parse(format!("r{i}")).unwrap(),
        })
        .collect();
    let missing = TurnKey {
        session_id: SessionId::generate(),
        request_id: RequestId::parse("r0").unwrap(),
    };
    // Round 0 claims the first 16 keys; round 1 all 24, with a claim in a
    // session that does not exist among them.
    for round in 0..2 {
        let (upto, fresh) = if round == 0 {
            (16, 0..16)
        } else {
            (24, 16..24)
        };
        // Every key three times over (three replicas), all at once.
        let claims = keys[..upto]
            .iter()
            .flat_map(|k| ["a", "b", "c"].map(|owner| (k.clone(), owner)))
            .map(|(k, owner)| {
                let store = store.clone();
                async move { (k.clone(), store.claim_turn(&new_turn(&k, owner)).await) }
            });
        let bad_turn = new_turn(&missing, "a");
        let bad = async {
            if round == 1 {
                assert!(
                    store.claim_turn(&bad_turn).await.is_err(),
                    "a claim in a session that does not exist fails"
                );
            }
        };
        let (claims, ()) = tokio::join!(futures::future::join_all(claims), bad);
        for (i, k) in keys[..upto].iter().enumerate() {
            let results: Vec<&Claim> = claims
                .iter()
                .filter(|(key, _)| key == k)
                .map(|(_, r)| r.as_ref().unwrap())
                .collect();
            let new = results.iter().filter(|c| ***c == Claim::New).count();
            let want = usize::from(fresh.contains(&i));
            assert_eq!(new, want, "round {round}, {k}: {results:?}");
            for c in results {
                if let Claim::Existing(t) = c {
                    assert_eq!(&t.key, k);
                    assert_eq!(t.user_text, format!("question {}", k.request_id));
                }
            }
            let stored = store.get_turn(k).await.unwrap().unwrap();
            assert!(["a", "b", "c"].contains(&stored.owner.as_str()));
        }
    }
    assert!(store.get_turn(&missing).await.unwrap().is_none());
    for s in &sessions {
        let now = store.get_session(s.id).await.unwrap().unwrap();
        assert!(
            now.updated_at > s.updated_at,
            "a claim marks its session updated"
        );
        assert_eq!(store.list_turns(s.id, None, 100).await.unwrap().len(), 12);
    }
}

/// Turns ending together store their last events and outcomes together
/// (one committer group); a turn that was never claimed fails alone and
/// records nothing. The session and its history are then read in one call:
/// oldest first, the last `limit`, none for a session that does not exist.
async fn turns_ending_together_store_their_last_events_and_outcomes(db: TestDb) {
    use agentd::agent::{Event, EventKind};
    use agentd::store::{EncodedEvent, SeqEvent, TurnOutcome, TurnState};
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap();
    let key = |i: usize| TurnKey {
        session_id: session.id,
        request_id: RequestId::parse(format!("r{i:02}")).unwrap(),
    };
    let keys: Vec<TurnKey> = (0..16).map(key).collect();
    for k in &keys {
        // One at a time: claim order is history order.
        assert_eq!(
            store.claim_turn(&new_turn(k, "a")).await.unwrap(),
            agentd::store::Claim::New
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let events = |k: &TurnKey| -> Vec<SeqEvent> {
        (0..3)
            .map(|seq| SeqEvent {
                seq,
                event: Event {
                    kind: if seq == 2 {
                        EventKind::FinalAnswer
                    } else {
                        EventKind::PartialText
                    },
                    author: "echo".into(),
                    text: format!("answer {} {seq}", k.request_id),
                    tool_name: String::new(),
                    tool_call_id: String::new(),
                    payload_json: String::new(),
                    created_unix_nanos: 1,
                },
            })
            .collect()
    };
    // Odd turns fail, even ones complete; all end at once.
    let outcome = |i: usize| {
        if i.is_multiple_of(2) {
            TurnOutcome {
                state: TurnState::Completed,
                code: 0,
                message: String::new(),
            }
        } else {
            TurnOutcome {
                state: TurnState::Failed,
                code: 14,
                message: "the model is unreachable".into(),
            }
        }
    };
    let ends = keys.iter().enumerate().map(|(i, k)| {
        let store = store.clone();
        let (events, outcome) = (events(k), outcome(i));
        async move {
            let answer = format!("answer {} 2", k.request_id);
            let encoded = events.iter().map(EncodedEvent::of).collect();
            store
                .append_and_finish(
                    k,
                    encoded,
                    &outcome,
                    i.is_multiple_of(2).then_some(answer.as_str().into()),
                )
                .await
        }
    });
    let never = key(99);
    let completed = outcome(0);
    let bad = store.append_and_finish(
        &never,
        events(&never).iter().map(EncodedEvent::of).collect(),
        &completed,
        Some("x".into()),
    );
    // The first half alone, then the second with the bad one among them.
    let mut ends: Vec<_> = ends.collect();
    let second = ends.split_off(keys.len() / 2);
    let mut done = futures::future::join_all(ends).await;
    let (rest, bad) = tokio::join!(futures::future::join_all(second), bad);
    done.extend(rest);
    assert!(bad.is_err(), "a turn never claimed is refused");
    assert!(store.get_turn(&never).await.unwrap().is_none());
    for (i, (k, r)) in keys.iter().zip(done).enumerate() {
        r.unwrap();
        let t = store.get_turn(k).await.unwrap().unwrap();
        assert_eq!(t.outcome, Some(outcome(i)), "{k}");
        assert_eq!(
            store.events_after(k, None, 10).await.unwrap(),
            events(k),
            "{k}"
        );
    }
    // A turn's outcome is kept once recorded.
    store
        .finish_turn(&keys[0], &outcome(1), None)
        .await
        .unwrap();
    assert_eq!(
        store.get_turn(&keys[0]).await.unwrap().unwrap().outcome,
        Some(outcome(0))
    );

    let (s, history) = store
        .session_with_history(session.id, 5)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(s.id, session.id);
    assert_eq!(s.user_id, alice);
    let ids: Vec<&str> = history.iter().map(|t| t.request_id.as_str()).collect();
    assert_eq!(
        ids,
        ["r11", "r12", "r13", "r14", "r15"],
        "the last five, oldest first"
    );
    assert_eq!(history[1].answer, "answer r12 2");
    assert_eq!(history[0].answer, "", "a failed turn has no answer");
    assert_eq!(history[0].user_text, "question r11");
    assert_eq!(history, store.history(session.id, 5).await.unwrap());
    let (_, none) = store
        .session_with_history(session.id, 0)
        .await
        .unwrap()
        .unwrap();
    assert!(none.is_empty());
    let fresh = store.create_session(&alice).await.unwrap();
    let (s, none) = store
        .session_with_history(fresh.id, 5)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((s.id, none.len()), (fresh.id, 0));
    assert!(
        store
            .session_with_history(SessionId::generate(), 5)
            .await
            .unwrap()
            .is_none()
    );
}

/// Every call of the store a server opens is timed, and a failure counted
/// by its cause; the SQL stores also time each group they write and count
/// what went into it. (Each test runs in a process of its own, so the
/// process's recorder holds just this test's calls.)
async fn every_store_call_is_timed_and_a_failure_counted(db: TestDb) {
    use agentd::agent::{Event, EventKind};
    use agentd::store::{Claim, EncodedEvent, SeqEvent, TurnOutcome, TurnState};
    let scrape = || prom::Metrics(agentd::telemetry::metrics::render());
    let calls =
        |m: &prom::Metrics, op: &str| m.count("agentd_store_call_seconds_count", &[("op", op)]);
    let store = db.open().await;
    let before = scrape();
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap();
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    assert_eq!(
        store.claim_turn(&new_turn(&key, "a")).await.unwrap(),
        Claim::New
    );
    assert!(matches!(
        store.claim_turn(&new_turn(&key, "b")).await.unwrap(),
        Claim::Existing(_)
    ));
    let missing = TurnKey {
        session_id: SessionId::generate(),
        request_id: RequestId::parse("r1").unwrap(),
    };
    assert!(store.claim_turn(&new_turn(&missing, "a")).await.is_err());
    let last = SeqEvent {
        seq: 0,
        event: Event {
            kind: EventKind::FinalAnswer,
            author: "echo".into(),
            text: "done".into(),
            tool_name: String::new(),
            tool_call_id: String::new(),
            payload_json: String::new(),
            created_unix_nanos: 1,
        },
    };
    let completed = TurnOutcome {
        state: TurnState::Completed,
        code: 0,
        message: String::new(),
    };
    store
        .append_and_finish(
            &key,
            vec![EncodedEvent::of(&last)],
            &completed,
            Some("done".into()),
        )
        .await
        .unwrap();
    store
        .session_with_history(session.id, 5)
        .await
        .unwrap()
        .unwrap();

    let after = scrape();
    let delta = |name: &str, labels: &[(&str, &str)]| {
        after.count(name, labels) - before.count(name, labels)
    };
    for (op, n) in [
        ("create_session", 1.0),
        ("claim_turn", 3.0),
        ("append_and_finish", 1.0),
        ("session_with_history", 1.0),
        ("get_turn", 0.0),
    ] {
        assert_eq!(
            calls(&after, op) - calls(&before, op),
            n,
            "{op}: {}",
            after.0
        );
    }
    let waited = delta("agentd_store_call_seconds_sum", &[("op", "claim_turn")]);
    assert!(waited > 0.0 && waited < 60.0, "claims took {waited} s");
    assert_eq!(
        delta(
            "agentd_store_errors_total",
            &[("op", "claim_turn"), ("error", "unexpected")]
        ),
        1.0,
        "the claim in a missing session: {}",
        after.0
    );
    assert_eq!(
        delta("agentd_store_errors_total", &[("op", "append_and_finish")]),
        0.0
    );
    // The SQL stores' groups: the three claims one after another (three
    // groups of one), the last events with the outcome (one commit group).
    let (claims, commits) = if db.url.starts_with("memory:") {
        (0.0, 0.0)
    } else {
        (3.0, 1.0)
    };
    for (queue, n) in [("claim", claims), ("commit", commits)] {
        let q = [("queue", queue)];
        assert_eq!(delta("agentd_store_group_size_count", &q), n, "{queue}");
        assert_eq!(delta("agentd_store_group_size_sum", &q), n, "{queue}");
        assert_eq!(delta("agentd_store_group_seconds_count", &q), n, "{queue}");
    }
}

/// The session and history a Run reads (`session_with_history`; on SQLite
/// from memory for the sessions created since start-up) follow every change
/// to the session, as the database reads them (`get_session`, `history`):
/// claims, turns ending out of order with and without an answer, a lease
/// that ran out, pruning, deletion.
async fn the_history_a_run_reads_follows_every_change_to_its_session(db: TestDb) {
    use agentd::store::{TurnOutcome, TurnState};
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let key = |id: SessionId, r: &str| TurnKey {
        session_id: id,
        request_id: RequestId::parse(r).unwrap(),
    };
    let same = |id: SessionId, want: &'static [&'static str]| {
        let store = store.clone();
        async move {
            let (s, read) = store.session_with_history(id, 5).await.unwrap().unwrap();
            assert_eq!(Some(s), store.get_session(id).await.unwrap());
            assert_eq!(read, store.history(id, 5).await.unwrap());
            let ids: Vec<&str> = read.iter().map(|t| t.request_id.as_str()).collect();
            assert_eq!(ids, want);
            read
        }
    };
    let end = |k: TurnKey, answer: Option<&'static str>| {
        let store = store.clone();
        async move { end_turn(store.as_ref(), &k, answer).await }
    };
    let a = store.create_session(&alice).await.unwrap().id;
    same(a, &[]).await;
    for r in ["r1", "r2", "r3"] {
        store.claim_turn(&new_turn(&key(a, r), "a")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    same(a, &[]).await;
    end(key(a, "r2"), Some("answer 2")).await;
    end(key(a, "r3"), None).await;
    same(a, &["r2", "r3"]).await;
    tokio::time::sleep(Duration::from_millis(2)).await;
    let mid = SystemTime::now();
    tokio::time::sleep(Duration::from_millis(2)).await;
    end(key(a, "r1"), Some("answer 1")).await;
    let read = same(a, &["r1", "r2", "r3"]).await;
    assert_eq!(
        (read[0].answer.as_str(), read[2].answer.as_str()),
        ("answer 1", "")
    );
    // A repeat claims nothing.
    store
        .claim_turn(&new_turn(&key(a, "r1"), "b"))
        .await
        .unwrap();
    same(a, &["r1", "r2", "r3"]).await;
    // Pruning goes by when turns ended: r1 ended last.
    assert_eq!(store.prune(mid, usize::MAX).await.unwrap(), 2);
    same(a, &["r1"]).await;
    let later = SystemTime::now() + Duration::from_secs(1);
    assert_eq!(store.prune(later, usize::MAX).await.unwrap(), 1);
    same(a, &[]).await;
    store
        .claim_turn(&new_turn(&key(a, "r4"), "a"))
        .await
        .unwrap();
    end(key(a, "r4"), Some("answer 4")).await;
    same(a, &["r4"]).await;

    // A turn whose lease ran out ends failed.
    let b = store.create_session(&alice).await.unwrap().id;
    let lapsing = NewTurn {
        lease: Duration::ZERO,
        ..new_turn(&key(b, "r1"), "a")
    };
    store.claim_turn(&lapsing).await.unwrap();
    same(b, &[]).await;
    let failed = TurnOutcome {
        state: TurnState::Failed,
        code: 14,
        message: "the serving replica stopped".into(),
    };
    lapse().await;
    assert_eq!(store.fail_expired(&failed).await.unwrap().len(), 1);
    same(b, &["r1"]).await;
    // Read again from the database (on SQLite, and held again from that
    // read), with a turn that was running at the read ending after it.
    store
        .claim_turn(&new_turn(&key(b, "r2"), "a"))
        .await
        .unwrap();
    let c = store.create_session(&alice).await.unwrap().id;
    let lapsing = NewTurn {
        lease: Duration::ZERO,
        ..new_turn(&key(c, "r1"), "a")
    };
    store.claim_turn(&lapsing).await.unwrap();
    lapse().await;
    assert_eq!(store.fail_expired(&failed).await.unwrap().len(), 1);
    same(b, &["r1"]).await;
    end(key(b, "r2"), Some("answer 2")).await;
    same(b, &["r1", "r2"]).await;
    store
        .claim_turn(&new_turn(&key(b, "r3"), "a"))
        .await
        .unwrap();
    end(key(b, "r3"), None).await;
    same(b, &["r1", "r2", "r3"]).await;
    same(c, &["r1"]).await;

    assert_eq!(
        store.delete_session(a).await.unwrap(),
        agentd::store::Deletion::Deleted
    );
    assert!(store.session_with_history(a, 5).await.unwrap().is_none());
    same(b, &["r1", "r2", "r3"]).await;
}

/// Ends a claimed turn with a final answer event: completed with `answer`,
/// or failed (INTERNAL, no answer) when there is none.
async fn end_turn(store: &dyn agentd::store::Store, key: &TurnKey, answer: Option<&str>) {
    use agentd::agent::{Event, EventKind};
    use agentd::store::{EncodedEvent, SeqEvent, TurnOutcome, TurnState};
    let last = SeqEvent {
        seq: 0,
        event: Event {
            kind: EventKind::FinalAnswer,
            author: "echo".into(),
            text: answer.unwrap_or_default().into(),
            tool_name: String::new(),
            tool_call_id: String::new(),
            payload_json: String::new(),
            created_unix_nanos: 1,
        },
    };
    let outcome = TurnOutcome {
        state: if answer.is_some() {
            TurnState::Completed
        } else {
            TurnState::Failed
        },
        code: if answer.is_some() { 0 } else { 13 },
        message: String::new(),
    };
    store
        .append_and_finish(
            key,
            vec![EncodedEvent::of(&last)],
            &outcome,
            answer.map(Into::into),
        )
        .await
        .unwrap();
}

/// Pruning deletes at most its limit of the ended turns per call, those
/// that ended first first, each with its event log; running turns and
/// turns that ended since stay, their events with them.
async fn pruning_deletes_a_bounded_batch_of_the_oldest_ended_turns_with_their_events(db: TestDb) {
    use agentd::store::{EncodedEvent, SeqEvent};
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let s = store.create_session(&alice).await.unwrap().id;
    let key = |r: &str| TurnKey {
        session_id: s,
        request_id: RequestId::parse(r).unwrap(),
    };
    for r in ["r0", "r1", "r2", "r3", "r4", "run", "new"] {
        store.claim_turn(&new_turn(&key(r), "a")).await.unwrap();
    }
    // Ended in another order than claimed, 2 ms apart; "new" after the
    // prune's bound.
    for r in ["r3", "r1", "r4", "r0", "r2"] {
        end_turn(store.as_ref(), &key(r), Some(r)).await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let bound = SystemTime::now();
    tokio::time::sleep(Duration::from_millis(2)).await;
    end_turn(store.as_ref(), &key("new"), Some("new")).await;
    let event = SeqEvent {
        seq: 0,
        event: agentd::agent::Event::partial("echo", "running".into()),
    };
    store
        .append_encoded(&key("run"), vec![EncodedEvent::of(&event)])
        .await
        .unwrap();
    // Rows of the event log, where the test can count them.
    let rows = |want: i64| {
        let db = &db;
        async move {
            if let Some(n) = event_log_rows(db).await {
                assert_eq!(n, want, "event log rows");
            }
        }
    };

    let left = || async {
        let mut ids: Vec<String> = store
            .list_turns(s, None, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.key.request_id.as_str().to_owned())
            .collect();
        ids.sort();
        ids
    };
    let logged = |r: &'static str| {
        let store = store.clone();
        async move {
            !store
                .events_after(&key(r), None, 10)
                .await
                .unwrap()
                .is_empty()
        }
    };
    rows(7).await;
    assert_eq!(store.prune(bound, 2).await.unwrap(), 2);
    assert_eq!(left().await, ["new", "r0", "r2", "r4", "run"]);
    rows(5).await;
    for r in ["r0", "r2", "r4", "run", "new"] {
        assert!(logged(r).await, "{r} keeps its events");
    }
    assert_eq!(store.prune(bound, 2).await.unwrap(), 2);
    assert_eq!(left().await, ["new", "r2", "run"]);
    assert_eq!(store.prune(bound, 2).await.unwrap(), 1);
    assert_eq!(store.prune(bound, 2).await.unwrap(), 0);
    assert_eq!(left().await, ["new", "run"]);
    rows(2).await;
    assert!(logged("run").await && logged("new").await);
}

/// Rows of the event log a SQL store's database holds (batches of events):
/// `None` for the memory store.
async fn event_log_rows(db: &TestDb) -> Option<i64> {
    use sqlx::Connection as _;
    let count = match db.backend {
        Backend::Memory => return None,
        Backend::Sqlite => {
            // The event log is a file of its own beside the database.
            let mut c = sqlx::SqliteConnection::connect(&format!("{}-events", db.url))
                .await
                .unwrap();
            sqlx::query_scalar("SELECT count(*) FROM event_log")
                .fetch_one(&mut c)
                .await
        }
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query_scalar("SELECT count(*) FROM event_batches")
                .fetch_one(&mut c)
                .await
        }
    };
    Some(count.unwrap())
}

/// A Run's read before its claim tells whether its turn is stored (a
/// repeated request id) at every step of the turn's life, and not for a
/// turn of another session; on the SQL stores also for a session another
/// process created (SQLite reads it, then holds it without knowing its
/// every turn) and for a session longer than SQLite holds in memory.
async fn a_runs_read_tells_whether_its_turn_is_stored(db: TestDb) {
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let key = |id: SessionId, r: &str| TurnKey {
        session_id: id,
        request_id: RequestId::parse(r).unwrap(),
    };
    let stored = |k: TurnKey| {
        let store = store.clone();
        async move {
            let read = store
                .session_for_run(k.session_id, Some(&k.request_id), 5)
                .await
                .unwrap()
                .unwrap();
            let (session, history) = store
                .session_with_history(k.session_id, 5)
                .await
                .unwrap()
                .unwrap();
            assert_eq!((&read.session, &read.history), (&session, &history));
            read.turn_stored
        }
    };
    let a = store.create_session(&alice).await.unwrap().id;
    let b = store.create_session(&alice).await.unwrap().id;
    assert!(!stored(key(a, "r1")).await);
    store
        .claim_turn(&new_turn(&key(a, "r1"), "a"))
        .await
        .unwrap();
    assert!(stored(key(a, "r1")).await, "running");
    assert!(!stored(key(b, "r1")).await, "another session's turn");
    end_turn(store.as_ref(), &key(a, "r1"), Some("one")).await;
    assert!(stored(key(a, "r1")).await, "ended");
    assert!(!stored(key(a, "r2")).await);
    let unasked = store.session_for_run(a, None, 5).await.unwrap().unwrap();
    assert!(!unasked.turn_stored, "no turn asked about");
    let r1 = RequestId::parse("r1").unwrap();
    assert!(
        store
            .session_for_run(SessionId::generate(), Some(&r1), 5)
            .await
            .unwrap()
            .is_none()
    );
    let later = SystemTime::now() + Duration::from_secs(1);
    assert_eq!(store.prune(later, usize::MAX).await.unwrap(), 1);
    assert!(!stored(key(a, "r1")).await, "pruned");

    if db.backend == Backend::Memory {
        return;
    }
    // Made by another process on the same database: this one reads it
    // (and SQLite then holds it), then asks again.
    let other = db.open().await;
    let c = other.create_session(&alice).await.unwrap().id;
    other
        .claim_turn(&new_turn(&key(c, "r1"), "b"))
        .await
        .unwrap();
    end_turn(other.as_ref(), &key(c, "r1"), Some("one")).await;
    other
        .claim_turn(&new_turn(&key(c, "r2"), "b"))
        .await
        .unwrap();
    for _ in 0..2 {
        assert!(stored(key(c, "r1")).await);
        assert!(stored(key(c, "r2")).await, "running elsewhere");
        assert!(!stored(key(c, "r3")).await);
    }
    // More ended turns than SQLite holds of a session (64).
    let d = store.create_session(&alice).await.unwrap().id;
    for i in 0..66 {
        let k = key(d, &format!("r{i}"));
        store.claim_turn(&new_turn(&k, "a")).await.unwrap();
        end_turn(store.as_ref(), &k, Some("answer")).await;
    }
    assert!(stored(key(d, "r0")).await, "among the oldest");
    assert!(stored(key(d, "r65")).await);
    assert!(!stored(key(d, "r66")).await);
}

/// Many Runs reading their sessions at once (PostgreSQL reads them in one
/// statement) each get their own session and its last turns, as a read of
/// that session alone gives them, whatever their history limit; a session
/// that does not exist is `None` among sessions that do.
async fn reads_made_together_each_get_their_own_session_and_history(db: TestDb) {
    let store = db.open().await;
    // On PostgreSQL the sessions are made through another replica's store,
    // so that this one reads them from the database, not from its memory
    // of the sessions it made.
    let other = match db.backend {
        Backend::Postgres => db.open().await,
        _ => store.clone(),
    };
    let alice = UserId::parse(ALICE).unwrap();
    let bob = UserId::parse("bob").unwrap();
    let mut sessions = Vec::new();
    for i in 0..12usize {
        let user = if i % 2 == 0 { &alice } else { &bob };
        let id = other.create_session(user).await.unwrap().id;
        // Session i: i % 6 ended turns, every third one failed (no
        // answer), and one still running when i is odd.
        for t in 0..i % 6 + i % 2 {
            let key = TurnKey {
                session_id: id,
                request_id: RequestId::parse(format!("s{i}-t{t}")).unwrap(),
            };
            other.claim_turn(&new_turn(&key, "a")).await.unwrap();
            if t == i % 6 {
                continue;
            }
            let answer = (t % 3 != 2).then(|| format!("answer {i}.{t}"));
            end_turn(other.as_ref(), &key, answer.as_deref()).await;
        }
        sessions.push(id);
    }
    sessions.extend((0..3).map(|_| SessionId::generate()));
    let reads: Vec<(SessionId, usize)> = (0..64)
        .map(|j| (sessions[j % sessions.len()], 1 + j % 5))
        .collect();
    let together = futures::future::join_all(
        reads
            .iter()
            .map(|&(id, limit)| store.session_with_history(id, limit)),
    )
    .await;
    let mut turns_read = 0;
    for (&(id, limit), got) in reads.iter().zip(together) {
        let got = got.unwrap();
        let Some(session) = store.get_session(id).await.unwrap() else {
            assert_eq!(got, None, "session {id} does not exist");
            continue;
        };
        let (read, history) = got.unwrap_or_else(|| panic!("session {id} was not found"));
        assert_eq!(read, session);
        assert_eq!(
            history,
            store.history(id, limit).await.unwrap(),
            "session {id}, limit {limit}"
        );
        assert!(history.len() <= limit);
        turns_read += history.len();
    }
    assert!(
        turns_read > 64,
        "the sessions hold history ({turns_read} turns read)"
    );
    if db.backend == Backend::Postgres {
        // The reads went in groups: fewer statements than reads.
        let m = prom::Metrics(agentd::telemetry::metrics::render());
        let labels = [("queue", "read")];
        let (groups, grouped) = (
            m.count("agentd_store_group_size_count", &labels),
            m.count("agentd_store_group_size_sum", &labels),
        );
        assert_eq!(grouped, 64.0, "every read went through the readers");
        assert!(
            groups < 32.0,
            "64 reads made together took {groups} statements"
        );
    }
}

/// A caller that goes away while its turn's claim is being written (here
/// the claim waits on a lock another connection holds; a store call timed
/// out by --store-timeout is the same) leaves nothing stored: the claim is
/// removed as soon as it is written, the agent never starts, and a retry
/// with the same request id runs the turn (a cancel recorded instead would
/// be replayed to a caller who never asked for one). (The memory store
/// claims without waiting.)
async fn a_caller_gone_during_its_claim_leaves_nothing_and_a_retry_runs_the_turn(db: TestDb) {
    // On a current-thread runtime: the server's tasks log under the capture.
    let logs = Logs::default();
    let _capture = logs.capture();
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    let held = db.hold_writes().await;
    let mut client = s.client.clone();
    let req = run_request(ALICE, &sid, "r1", ORDER_Q);
    let call = tokio::spawn(async move {
        client
            .run(req, Duration::from_secs(30))
            .await
            .map(|c| c.mode)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "the claim waits for the held lock");
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    // The reset reaches the server, which drops the call, claim and all.
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release().await;
    // The claim is written, then removed when its caller is found gone.
    // (No turn is listed before the write either: the withdrawal's log
    // line is what says the claim was written and deleted.)
    eventually("the abandoned claim to be withdrawn", || async {
        logs.lines_from(0)
            .iter()
            .any(|l| {
                l["session"] == sid.as_str()
                    && l["request_id"] == "r1"
                    && l["message"]
                        .as_str()
                        .is_some_and(|m| m.ends_with("; the claim is released for a retry"))
            })
            .then_some(())
    })
    .await;
    let info = s.get_session(ALICE, &sid).await.unwrap();
    assert!(info.turns.is_empty(), "{:?}", info.turns);
    assert_eq!(s.stats.started(), 0, "the agent never started");

    let (events, end) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    end.unwrap();
    assert!(
        events.last().is_some_and(|e| e.is_final),
        "the retry ran the turn: {events:?}"
    );
    assert_eq!(s.stats.started(), 1);
    s.stop().await;
}

/// A retry sent while the claim of a caller that left is still being
/// written (and then withdrawn) is never told the turn is gone (NOT_FOUND)
/// or broken (INTERNAL): it runs the turn, or gets UNAVAILABLE without the
/// recorded trailer, and a retry after that runs it.
async fn a_retry_sent_while_an_abandoned_claim_is_withdrawn_runs_the_turn_or_may_retry(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    let held = db.hold_writes().await;
    let mut client = s.client.clone();
    let req = run_request(ALICE, &sid, "r1", ORDER_Q);
    let gone =
        tokio::spawn(async move { client.run(req, Duration::from_secs(30)).await.map(drop) });
    tokio::time::sleep(Duration::from_millis(300)).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let retry = {
        let client = s.client.clone();
        let sid = sid.clone();
        tokio::spawn(async move { run_on(&client, ALICE, &sid, "r1", ORDER_Q).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release().await;
    let (events, end) = retry.await.unwrap();
    match end {
        Ok(()) => assert!(events.last().is_some_and(|e| e.is_final), "{events:?}"),
        Err(st) => {
            assert_eq!(st.code(), Code::Unavailable, "{st:?}");
            assert!(
                st.metadata().get("agentd-turn-outcome").is_none(),
                "a retryable status carries no recorded trailer: {st:?}"
            );
            let (events, end) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
            end.unwrap();
            assert!(events.last().is_some_and(|e| e.is_final), "{events:?}");
        }
    }
    assert_eq!(s.stats.started(), 1, "the agent ran once");
    s.stop().await;
}

/// A claim whose caller left after the claimer handed its answer over but
/// before the caller read it (its call dropped in between) is removed too:
/// nobody would run the turn, which stayed `running` until its lease made
/// it "replica stopped".
async fn a_claim_answered_but_never_read_is_removed(db: TestDb) {
    let store = db.open().await;
    let sid = alice_session(&*store).await.id;
    let key = TurnKey {
        session_id: sid,
        request_id: RequestId::parse("r1").unwrap(),
    };
    let turn = new_turn(&key, "replica-a");
    let held = db.hold_writes().await;
    let mut claim = Box::pin(store.claim_turn(&turn));
    assert!(futures::poll!(&mut claim).is_pending());
    held.release().await;
    // The claimer writes the claim and hands the answer over; the claim's
    // future is not polled again to read it.
    eventually("the claim to be written", || async {
        store.get_turn(&key).await.unwrap().map(drop)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(claim);
    eventually("the unread claim to be removed", || async {
        store.get_turn(&key).await.unwrap().is_none().then_some(())
    })
    .await;
}

/// SQLite (one claimer): a claim whose caller went away while it waited
/// behind another (it cancelled, or its store call timed out and it was told
/// to retry) is not stored at all: a retry claims the turn anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_claim_whose_caller_left_while_it_was_queued_is_not_stored() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let store = db.open().await;
    let sid = alice_session(&*store).await.id;
    let key = |rid: &str| TurnKey {
        session_id: sid,
        request_id: RequestId::parse(rid).unwrap(),
    };
    let claim = |rid: &str| {
        let (store, turn) = (store.clone(), new_turn(&key(rid), "replica-a"));
        tokio::spawn(async move { store.claim_turn(&turn).await })
    };
    let held = db.hold_writes().await;
    let first = claim("r1");
    // The claimer has taken r1 and waits for the lock; r2 waits behind it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let queued = claim("r2");
    tokio::time::sleep(Duration::from_millis(100)).await;
    queued.abort();
    assert!(queued.await.unwrap_err().is_cancelled());
    held.release().await;
    assert_eq!(first.await.unwrap().unwrap(), agentd::store::Claim::New);
    // Claimed after r2 was taken from the queue.
    assert_eq!(
        claim("r3").await.unwrap().unwrap(),
        agentd::store::Claim::New
    );
    assert!(store.get_turn(&key("r2")).await.unwrap().is_none());
    assert_eq!(
        claim("r2").await.unwrap().unwrap(),
        agentd::store::Claim::New
    );
}

/// Sessions that hold no turns (never used, or every turn pruned) go once
/// they were last updated (created, or given a turn) before the bound,
/// oldest first, a batch at a time; a session with a turn, running or
/// ended, stays, and so does one updated after the bound.
async fn sessions_left_with_no_turns_are_pruned_oldest_first(db: TestDb) {
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let session = || async { store.create_session(&alice).await.unwrap().id };
    let turn = |s: SessionId| TurnKey {
        session_id: s,
        request_id: RequestId::parse("r1").unwrap(),
    };
    let used = session().await;
    store
        .claim_turn(&new_turn(&turn(used), "replica-a"))
        .await
        .unwrap();
    end_turn(&*store, &turn(used), Some("done")).await;
    let running = session().await;
    store
        .claim_turn(&new_turn(&turn(running), "replica-a"))
        .await
        .unwrap();
    let empty = session().await;
    // A session whose only trace is an A2A task (one waiting for input, say,
    // its turns pruned) keeps it: the task reads it.
    let tasked = session().await;
    let task = a2a::Task {
        metadata: Some(
            [(
                agentd::store::a2a_tasks::SESSION_METADATA_KEY.to_owned(),
                serde_json::json!(tasked.to_string()),
            )]
            .into(),
        ),
        ..a2a_task("waits", a2a::TaskState::InputRequired)
    };
    store.a2a_tasks().create_for(&alice, task).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2)).await;
    let mid = SystemTime::now();
    tokio::time::sleep(Duration::from_millis(2)).await;
    let newer = session().await;
    // Every session read once, so SQLite's cache holds them.
    for s in [used, running, empty, newer] {
        assert!(store.session_with_history(s, 5).await.unwrap().is_some());
    }
    let exists = |s: SessionId| {
        let store = store.clone();
        async move { store.session_with_history(s, 5).await.unwrap().is_some() }
    };

    assert_eq!(store.prune_sessions(mid, usize::MAX).await.unwrap(), 1);
    assert!(!exists(empty).await, "never used, older than the bound");
    assert!(exists(tasked).await, "an A2A task keeps its session");
    assert!(store.get_session(empty).await.unwrap().is_none());
    for s in [used, running, newer] {
        assert!(exists(s).await);
    }

    let later = SystemTime::now() + Duration::from_secs(3600);
    assert_eq!(store.prune(later, usize::MAX).await.unwrap(), 1);
    assert_eq!(store.prune_sessions(later, 1).await.unwrap(), 1, "a batch");
    assert!(!exists(used).await, "its turn pruned, the oldest left");
    assert!(exists(newer).await);
    assert_eq!(store.prune_sessions(later, 1).await.unwrap(), 1);
    assert!(!exists(newer).await);
    assert_eq!(store.prune_sessions(later, 1).await.unwrap(), 0);
    assert!(exists(running).await, "a running turn keeps its session");
    assert!(store.get_turn(&turn(running)).await.unwrap().is_some());
}

/// A server with a session retention deletes a session left unused past it.
async fn an_unused_session_is_deleted_past_the_session_retention(db: TestDb) {
    let store = db.open().await;
    let opts = Opts {
        retain_sessions: Some(Duration::from_secs(2)),
        ..Opts::default()
    };
    let s = Server::start(store.clone(), opts).await;
    let sid = s.session(ALICE).await;
    assert!(s.get_session(ALICE, &sid).await.is_ok());
    eventually("the unused session to be pruned", || async {
        (s.get_session(ALICE, &sid).await.err()?.code() == Code::NotFound).then_some(())
    })
    .await;
    s.stop().await;
}

/// A prune that takes a full batch, then one that finds nothing more: the
/// history a Run reads has none of the pruned turns (SQLite's cache of
/// sessions let go of them too).
async fn a_turn_pruned_by_a_full_batch_leaves_the_history_a_run_reads(db: TestDb) {
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap();
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    store
        .claim_turn(&new_turn(&key, "replica-a"))
        .await
        .unwrap();
    end_turn(&*store, &key, Some("done")).await;
    let later = SystemTime::now() + Duration::from_secs(3600);
    assert_eq!(store.prune(later, 1).await.unwrap(), 1, "a full batch");
    assert_eq!(store.prune(later, 1).await.unwrap(), 0, "nothing more");
    let (_, history) = store
        .session_with_history(session.id, 5)
        .await
        .unwrap()
        .unwrap();
    assert!(history.is_empty(), "{history:?}");
}

/// SQLite: a deleted session's event log goes after DeleteSession has
/// answered, so the answer does not wait for it: not even while another
/// connection holds the log's file, whose rows then go once it lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_deleted_sessions_event_log_goes_after_the_answer() {
    use sqlx::Connection as _;
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let store = db.open().await;
    let session = alice_session(&*store).await;
    for r in ["r1", "r2"] {
        let key = TurnKey {
            session_id: session.id,
            request_id: RequestId::parse(r).unwrap(),
        };
        store.claim_turn(&new_turn(&key, "a")).await.unwrap();
        end_turn(&*store, &key, Some("done")).await;
    }
    assert_eq!(event_log_rows(&db).await, Some(2));
    let mut holder = sqlx::SqliteConnection::connect(&format!("{}-events", db.url))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let deleted = tokio::time::timeout(Duration::from_secs(60), store.delete_session(session.id))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(deleted, agentd::store::Deletion::Deleted);
    // Still held here: had the answer waited for the log, its delete would
    // have given up on the lock by now, and its rows would stay.
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    drop(holder);
    eventually("the deleted session's event log is gone", || async {
        (event_log_rows(&db).await == Some(0)).then_some(())
    })
    .await;
}

/// SQLite: the two files commit one after the other, so a delete cut
/// between them leaves events of a turn that is gone. A new turn never takes
/// that turn's number (it would read those events as its own), and the next
/// start drops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_events_left_by_a_cut_delete_are_never_read_by_a_new_turn_and_are_dropped_at_start()
 {
    use sqlx::Connection as _;
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap();
    let key = |r: &str| TurnKey {
        session_id: session.id,
        request_id: RequestId::parse(r).unwrap(),
    };
    store
        .claim_turn(&new_turn(&key("r1"), "replica-a"))
        .await
        .unwrap();
    end_turn(&*store, &key("r1"), Some("one")).await;
    // As if turn 2 had been deleted from the main file and not the event log.
    let path = db.url.trim_start_matches("sqlite://").to_owned() + "-events";
    let mut ev = sqlx::SqliteConnection::connect(&format!("sqlite://{path}"))
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO event_log SELECT turn_no + 1, first_seq, last_seq, events FROM event_log",
    )
    .execute(&mut ev)
    .await
    .unwrap();
    store
        .claim_turn(&new_turn(&key("r2"), "replica-a"))
        .await
        .unwrap();
    assert!(
        store
            .events_after(&key("r2"), None, 10)
            .await
            .unwrap()
            .is_empty(),
        "a new turn reads no events it did not write"
    );
    end_turn(&*store, &key("r2"), Some("two")).await;
    assert_eq!(
        store
            .events_after(&key("r2"), None, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    drop(store);
    let store = db.open().await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM event_log")
        .fetch_one(&mut ev)
        .await
        .unwrap();
    assert_eq!(
        rows, 2,
        "the orphan row was dropped at start, the turns' rows kept"
    );
    assert_eq!(
        store
            .events_after(&key("r1"), None, 10)
            .await
            .unwrap()
            .len(),
        1
    );
}

/// A store that stops taking writes fills the run's queue to its writer:
/// waiting for room there, the run still ends at its deadline (not when the
/// store gives up, up to its group timeout later). Its outcome could not be
/// stored, so the call ends UNAVAILABLE, without the `recorded` trailer.
async fn a_run_blocked_on_a_stalled_store_still_ends_at_its_deadline(db: TestDb) {
    let s = Server::start(db.open().await, Opts::default()).await;
    let sid = s.session(ALICE).await;
    let req = pb::RunRequest {
        agent: "stream".into(),
        ..run_request(ALICE, &sid, "r1", "n=1000000 size=8")
    };
    // The raw client: tonic times only the response headers, so the
    // status that ends the stream is the server's.
    let mut r = Request::new(req);
    r.set_timeout(Duration::from_millis(1500));
    let mut events = s.raw().run(r).await.unwrap().into_inner();
    events.message().await.unwrap().unwrap();
    let held = db.hold_writes().await;
    let ended = tokio::time::timeout(Duration::from_secs(10), collect(&mut events)).await;
    held.release().await;
    let (_, end) = ended.expect("the run ended while the store was stalled");
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.metadata().get("agentd-turn-outcome").is_none());
    s.stop().await;
}

/// PostgreSQL: a run whose end cannot be committed in time (its turn's row
/// locked by another transaction) ends UNAVAILABLE, not OK, and not marked
/// recorded: a follow-up would not find the turn in its history yet. Once
/// the outcome commits, a retry with the same request id replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_run_whose_outcome_is_not_stored_in_time_ends_unavailable_not_ok() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let s = Server::start(
        db.open().await,
        Opts {
            tool_delay: Duration::from_millis(500),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let mut r = Request::new(run_request(ALICE, &sid, "r1", ORDER_Q));
    r.set_timeout(Duration::from_secs(2));
    let mut events = s.raw().run(r).await.unwrap().into_inner();
    events.message().await.unwrap().unwrap();
    let held = db.hold_writes().await;
    let ended = tokio::time::timeout(Duration::from_secs(30), collect(&mut events)).await;
    let (seen, end) = ended.expect("the run ended while its outcome could not be stored");
    assert_eq!(
        seen.last().map(|e| e.kind),
        Some(pb::EventKind::FinalAnswer as i32)
    );
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.metadata().get("agentd-turn-outcome").is_none(),
        "not the turn's recorded outcome"
    );
    held.release().await;
    eventually("the retry replays the stored turn", || async {
        let (events, end) = s.attach(ALICE, &sid, "r1", None).await.ok()?;
        (end.is_ok() && events.len() == 3).then_some(())
    })
    .await;
    s.stop().await;
}

/// PostgreSQL: a batch of events whose turn is being ended at that moment
/// by another transaction (a `CancelTurn` on another replica, a sweep of an
/// expired lease) waits for that end, and once it commits the batch is not
/// stored: a follower that stopped at the end it read misses nothing that
/// a replay would show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_events_racing_their_turns_end_wait_for_it_and_are_refused() {
    use sqlx::Connection as _;
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let store = db.open().await;
    let sid = alice_session(&*store).await.id;
    let key = TurnKey {
        session_id: sid,
        request_id: RequestId::parse("r1").unwrap(),
    };
    store
        .claim_turn(&new_turn(&key, "replica-a"))
        .await
        .unwrap();
    store
        .append_events(&key, vec![text_event(0, "before")])
        .await
        .unwrap();
    let mut canceller = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut cancel = canceller.begin().await.unwrap();
    sqlx::query(
        "UPDATE turns SET state = 'cancelled', status_code = 1, status_message = 'cancelled', updated_at = 1 \
         WHERE session_id = $1 AND request_id = 'r1' AND state = 'running'",
    )
    .bind(sid.to_string())
    .execute(&mut *cancel)
    .await
    .unwrap();
    let append = tokio::spawn({
        let (store, key) = (store.clone(), key.clone());
        async move {
            store
                .append_events(&key, vec![text_event(1, "during")])
                .await
        }
    });
    let watcher = sqlx::PgPool::connect(&db.url).await.unwrap();
    a_statement_waits_for_a_lock(&watcher, "the batch waits for the turn's end").await;
    cancel.commit().await.unwrap();
    append.await.unwrap().unwrap();
    let texts: Vec<String> = store
        .events_after(&key, None, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.event.text)
        .collect();
    assert_eq!(texts, ["before"], "no event lands after the turn ended");
}

/// PostgreSQL, for the migration tests: `db` migrated, then migration
/// `version` taken back (`undo` reverts its change), as the release before
/// it left the database; and a connection that ran `hold` in a transaction
/// it keeps open (`COMMIT` on it ends that). Returns a pool to look with,
/// and that connection.
async fn before_migration(
    db: &TestDb,
    version: i64,
    undo: &str,
    hold: &str,
) -> (sqlx::PgPool, sqlx::PgConnection) {
    use sqlx::Connection as _;
    db.open().await;
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::raw_sql(&format!(
        "{undo}; DELETE FROM _sqlx_migrations WHERE version = {version}"
    ))
    .execute(&admin)
    .await
    .unwrap();
    let mut long = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql(&format!("BEGIN; {hold}"))
        .execute(&mut long)
        .await
        .unwrap();
    (admin, long)
}

/// Opens a store on `db`, migrating it, within a minute. Driven beside a
/// test's checks in its own task (the store's future is not `Send` for
/// every lifetime, as a spawned task's must be).
async fn migrate_within_a_minute(db: &TestDb) -> anyhow::Result<()> {
    tokio::time::timeout(Duration::from_secs(60), agentd::store::open(&db.url))
        .await
        .expect("the migration went through once the transaction ended")
        .map(|_| ())
}

/// PostgreSQL: a migration that finds its table held by a long transaction
/// (a report, a backup) waits for it only a moment at a time, so the
/// replicas still serving are not queued behind it; it goes through once
/// the transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_migration_held_up_by_a_long_transaction_does_not_hold_up_the_tables() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    // The database as the release before the answer's payload left it,
    // and a report reading the table in a transaction left open.
    let (admin, mut report) = before_migration(
        &db,
        10,
        "ALTER TABLE turns DROP COLUMN answer_payload",
        "SELECT count(*) FROM turns",
    )
    .await;
    let migrated = std::sync::atomic::AtomicBool::new(false);
    let migrating = async {
        let opened = migrate_within_a_minute(&db).await;
        migrated.store(true, std::sync::atomic::Ordering::SeqCst);
        opened
    };
    let checks = async {
        a_statement_waits_for_a_lock(&admin, "the migration waits for the long transaction").await;
        // A serving replica's reads of the table keep getting through.
        let serving = sqlx::PgPool::connect(&db.url).await.unwrap();
        for _ in 0..3 {
            let read =
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM turns").fetch_one(&serving);
            tokio::time::timeout(Duration::from_secs(10), read)
                .await
                .expect("a read of the table was held up behind the migration")
                .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert!(
            !migrated.load(std::sync::atomic::Ordering::SeqCst),
            "the migration waits for the table"
        );
        sqlx::raw_sql("COMMIT").execute(&mut report).await.unwrap();
    };
    let (opened, ()) = tokio::join!(migrating, checks);
    opened.unwrap();
    let added: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
         WHERE table_schema = current_schema() AND table_name = 'turns' AND column_name = 'answer_payload')",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(added);
}

/// PostgreSQL: an index a migration builds CONCURRENTLY, which holds up
/// none of the table's users, waits for a long transaction on its table as
/// long as that lasts: it is not cut short by the migrations' lock wait
/// and built again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_an_index_built_concurrently_waits_out_a_long_transaction_in_one_go() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    // A writer's lock on the table, held: the build waits for it.
    let (admin, mut writer) = before_migration(
        &db,
        8,
        "DROP INDEX sessions_by_update",
        "UPDATE sessions SET updated_at = updated_at WHERE false",
    )
    .await;
    let migrating = migrate_within_a_minute(&db);
    let build = || {
        let admin = admin.clone();
        async move {
            sqlx::query_as::<_, (i32, i64)>(
                "SELECT pid, (extract(epoch FROM query_start) * 1e6)::int8 FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock' \
                 AND query LIKE '%CREATE INDEX CONCURRENTLY%'",
            )
            .fetch_optional(&admin)
            .await
            .unwrap()
        }
    };
    let checks = async {
        let first = eventually("the build waits for the transaction", &build).await;
        // Past the migrations' 2 s lock wait and the pause before a retry.
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert_eq!(build().await, Some(first), "the same build, still waiting");
        sqlx::raw_sql("COMMIT").execute(&mut writer).await.unwrap();
    };
    let (opened, ()) = tokio::join!(migrating, checks);
    opened.unwrap();
    let valid: bool = sqlx::query_scalar(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE c.relname = 'sessions_by_update' AND c.relnamespace = current_schema()::regnamespace",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(valid);
}

/// PostgreSQL: a store's connection listening for cancels closes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_connection_listening_for_cancels_closes_with_the_store() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let store = db.open().await;
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    let listeners = || {
        let admin = admin.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND query LIKE 'LISTEN%'",
            )
            .fetch_one(&admin)
            .await
            .unwrap()
        }
    };
    eventually("the store listens", || async {
        (listeners().await == 1).then_some(())
    })
    .await;
    store.close().await;
    eventually("the listening connection is closed", || async {
        (listeners().await == 0).then_some(())
    })
    .await;
}

/// PostgreSQL: claims of several replicas commit in any order, so a claim
/// never moves its session's `updated_at` back (as one made earlier but
/// committed later would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_claim_never_moves_its_sessions_update_time_back() {
    use sqlx::Connection as _;
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let store = db.open().await;
    let session = alice_session(&*store).await;
    let later = session.updated_at + Duration::from_secs(3600);
    let later_micros = later
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("UPDATE sessions SET updated_at = $1 WHERE id = $2")
        .bind(later_micros)
        .bind(session.id.to_string())
        .execute(&mut c)
        .await
        .unwrap();
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    store
        .claim_turn(&new_turn(&key, "replica-a"))
        .await
        .unwrap();
    let now = store.get_session(session.id).await.unwrap().unwrap();
    assert_eq!(now.updated_at, later, "not moved back by the claim");
}

/// PostgreSQL, two replicas on one database: the history replica A keeps
/// in memory of a session (one it created, or read while none of its turns
/// ran) answers A's Runs until A's next claim in the session finds a claim
/// A did not make (replica B's). That Run then reads the history again, and
/// A keeps the session again only once none of its turns runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_history_kept_in_memory_holds_until_another_replica_claims_in_its_session() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let (a, b) = (db.open().await, db.open().await);
    let alice = UserId::parse(ALICE).unwrap();
    let key = |id: SessionId, r: &str| TurnKey {
        session_id: id,
        request_id: RequestId::parse(r).unwrap(),
    };
    let ids = |read: &agentd::store::RunRead| -> Vec<String> {
        read.history.iter().map(|t| t.request_id.clone()).collect()
    };
    let s = a.create_session(&alice).await.unwrap().id;
    let read = a.session_for_run(s, None, 5).await.unwrap().unwrap();
    let held = read.remembered.expect("created here: from memory");
    assert!(read.history.is_empty());
    // B runs r1 to its end; A's memory does not know.
    b.claim_turn(&new_turn(&key(s, "r1"), "b")).await.unwrap();
    end_turn(b.as_ref(), &key(s, "r1"), Some("answer 1")).await;
    let read = a.session_for_run(s, None, 5).await.unwrap().unwrap();
    assert_eq!(read.remembered, Some(held));
    assert!(read.history.is_empty(), "what A knew");
    // A's claim finds B's: the history A served does not hold.
    assert!(matches!(
        a.claim_turn(&new_turn(&key(s, "r2"), "a")).await.unwrap(),
        agentd::store::Claim::New
    ));
    assert!(!a.history_current(s, held));
    let again = a.session_for_run(s, None, 5).await.unwrap().unwrap();
    assert_eq!(ids(&again), ["r1"]);
    assert_eq!(again.remembered, None, "read from the database");
    // r2 runs: a read now is not kept (r2's end would go unseen by one
    // read while it ran, were it B's).
    let again = a.session_for_run(s, None, 5).await.unwrap().unwrap();
    assert_eq!(again.remembered, None);
    end_turn(a.as_ref(), &key(s, "r2"), Some("answer 2")).await;
    let read = a.session_for_run(s, None, 5).await.unwrap().unwrap();
    assert_eq!(ids(&read), ["r1", "r2"]);
    assert_eq!(read.remembered, None, "read, and kept from now on");
    let read = a.session_for_run(s, None, 5).await.unwrap().unwrap();
    assert_eq!(ids(&read), ["r1", "r2"]);
    let held = read.remembered.expect("kept");
    // A's own claims keep it: the count is the one A holds.
    a.claim_turn(&new_turn(&key(s, "r3"), "a")).await.unwrap();
    assert!(a.history_current(s, held));
    end_turn(a.as_ref(), &key(s, "r3"), None).await;
    let read = a.session_for_run(s, None, 5).await.unwrap().unwrap();
    assert_eq!(ids(&read), ["r1", "r2", "r3"]);
    assert_eq!(read.remembered, Some(held));
    // Which turns are stored, A's memory tells of those it knows (B's r1,
    // read from the database)...
    let r1 = RequestId::parse("r1").unwrap();
    assert!(
        a.session_for_run(s, Some(&r1), 5)
            .await
            .unwrap()
            .unwrap()
            .turn_stored
    );
    // ... and not of one B stored since, still running: said not stored,
    // it is found by A's claim, which stores nothing.
    b.claim_turn(&new_turn(&key(s, "r4"), "b")).await.unwrap();
    let r4 = RequestId::parse("r4").unwrap();
    let read = a.session_for_run(s, Some(&r4), 5).await.unwrap().unwrap();
    assert!(!read.turn_stored);
    assert_eq!(read.remembered, Some(held));
    assert!(matches!(
        a.claim_turn(&new_turn(&key(s, "r4"), "a")).await.unwrap(),
        agentd::store::Claim::Existing(t) if t.owner == "b"
    ));
    a.claim_turn(&new_turn(&key(s, "r5"), "a")).await.unwrap();
    assert!(!a.history_current(s, held));
    // Deleted by B: A's next claim fails for the session and lets it go.
    let t = b.create_session(&alice).await.unwrap().id;
    let read = a.session_for_run(t, None, 5).await.unwrap().unwrap();
    assert_eq!(read.remembered, None);
    let read = a.session_for_run(t, None, 5).await.unwrap().unwrap();
    assert!(read.remembered.is_some(), "no turn: kept");
    b.delete_session(t).await.unwrap();
    assert!(a.claim_turn(&new_turn(&key(t, "r1"), "a")).await.is_err());
    assert!(a.session_for_run(t, None, 5).await.unwrap().is_none());
}

/// PostgreSQL, two replicas: when replica A's memory of a session turns out
/// stale at its claim and the history cannot be read again, the turn A
/// claimed ends UNAVAILABLE, recorded, rather than running without the
/// other replica's turn or staying claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_stale_history_that_cannot_be_read_again_ends_the_turn_unavailable() {
    /// Fails the reads that name no turn: the second read of a stale
    /// history (a Run's own read names its request id).
    struct FailSecondRead;
    #[async_trait::async_trait]
    impl store_wrap::Hooks for FailSecondRead {
        async fn session_for_run(
            &self,
            inner: &dyn agentd::store::Store,
            s: SessionId,
            t: Option<&RequestId>,
            limit: usize,
        ) -> agentd::store::StoreResult<Option<agentd::store::RunRead>> {
            match t {
                None => Err(agentd::store::StoreError::Unavailable(anyhow::anyhow!(
                    "the test's read failed"
                ))),
                Some(_) => inner.session_for_run(s, t, limit).await,
            }
        }
    }
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let wrapped: std::sync::Arc<dyn agentd::store::Store> =
        std::sync::Arc::new(store_wrap::Wrapped {
            inner: db.open().await,
            hooks: std::sync::Arc::new(FailSecondRead),
        });
    let a = Server::start(wrapped, Opts::default()).await;
    let b = Server::start(db.open().await, Opts::default()).await;
    let sid = a.session(ALICE).await;
    run_agent(&a, &sid, "r1", "notes", "one").await.1.unwrap();
    run_agent(&b, &sid, "r2", "notes", "two").await.1.unwrap();
    let (_, ended) = run_agent(&a, &sid, "r3", "notes", "three").await;
    assert_eq!(code(&ended), Code::Unavailable, "{ended:?}");
    let turn = a.ended_turn(ALICE, &sid, "r3").await;
    assert_eq!(turn.status_code, Some(Code::Unavailable as i32), "{turn:?}");
    a.stop().await;
    b.stop().await;
}

/// PostgreSQL, two replicas serving one session by turns: each Run's agent
/// gets every earlier turn in its history, whichever replica ran it, though
/// each replica keeps the session's history in memory between its Runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_each_replicas_runs_see_the_turns_the_other_ran() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = Server::start(db.open().await, Opts::default()).await;
    let b = Server::start(db.open().await, Opts::default()).await;
    let sid = a.session(ALICE).await;
    let mut seen = Vec::new();
    for (i, replica) in [&a, &a, &b, &a, &b, &b, &a].into_iter().enumerate() {
        let rid = format!("r{i}");
        let (events, ok) = run_agent(replica, &sid, &rid, "notes", &rid).await;
        ok.unwrap();
        assert_eq!(events.last().unwrap().text, seen.join("\n"), "turn {rid}");
        seen.push(format!(r#"{rid} notes {{"note":"{rid}"}}"#));
    }
    a.stop().await;
    b.stop().await;
}

mod slow_store {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_blocked_on_a_stalled_store_still_ends_at_its_deadline_on_postgres() {
        if let Some(db) = super::TestDb::fresh(super::Backend::Postgres).await {
            super::a_run_blocked_on_a_stalled_store_still_ends_at_its_deadline(db).await
        }
    }
}

mod drain {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_admitted_as_the_drain_begins_gets_the_grace_on_sqlite() {
        let db = super::TestDb::fresh(super::Backend::Sqlite).await.unwrap();
        super::a_run_admitted_as_the_drain_begins_gets_the_grace(db).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_admitted_as_the_drain_begins_gets_the_grace_on_postgres() {
        if let Some(db) = super::TestDb::fresh(super::Backend::Postgres).await {
            super::a_run_admitted_as_the_drain_begins_gets_the_grace(db).await
        }
    }
}

fn text_event(seq: u64, text: &str) -> agentd::store::SeqEvent {
    agentd::store::SeqEvent {
        seq,
        event: agentd::agent::Event {
            kind: agentd::agent::EventKind::PartialText,
            author: "echo".into(),
            text: text.into(),
            tool_name: String::new(),
            tool_call_id: String::new(),
            payload_json: String::new(),
            created_unix_nanos: seq as i64,
        },
    }
}

/// A turn failed under its writer (its lease ran out and a sweep ended it)
/// takes neither more events nor another outcome: its followers saw it end
/// there, and a replay shows the same. The writer is told its outcome was
/// not recorded; a running turn's is.
async fn a_turn_failed_under_its_writer_keeps_the_log_and_outcome_it_ended_with(db: TestDb) {
    use agentd::store::{EncodedEvent, TurnOutcome, TurnState};
    let store = db.open().await;
    let sid = alice_session(&*store).await.id;
    let key = |rid: &str| TurnKey {
        session_id: sid,
        request_id: RequestId::parse(rid).unwrap(),
    };
    let lapsing = NewTurn {
        lease: Duration::ZERO,
        ..new_turn(&key("r1"), "replica-a")
    };
    store.claim_turn(&lapsing).await.unwrap();
    store
        .append_events(&key("r1"), vec![text_event(0, "before")])
        .await
        .unwrap();
    let stopped = agentd::grpc::status::replica_stopped();
    lapse().await;
    let swept = store.fail_expired(&stopped).await.unwrap();
    assert_eq!(swept.len(), 1);

    let ok = TurnOutcome {
        state: TurnState::Completed,
        code: 0,
        message: String::new(),
    };
    store
        .append_events(&key("r1"), vec![text_event(1, "during")])
        .await
        .unwrap();
    let late = vec![EncodedEvent::of(&text_event(2, "after"))];
    let recorded = store
        .append_and_finish(&key("r1"), late, &ok, Some("answer".into()))
        .await
        .unwrap();
    assert!(!recorded, "the writer hears its outcome was not recorded");
    assert!(!store.finish_turn(&key("r1"), &ok, None).await.unwrap());
    let turn = store.get_turn(&key("r1")).await.unwrap().unwrap();
    assert_eq!(turn.state, TurnState::Failed);
    assert_eq!(turn.outcome, Some(stopped));
    let texts: Vec<String> = store
        .events_after(&key("r1"), None, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.event.text)
        .collect();
    assert_eq!(texts, ["before"], "no event lands after the turn ended");

    store
        .claim_turn(&new_turn(&key("r2"), "replica-a"))
        .await
        .unwrap();
    let last = vec![EncodedEvent::of(&text_event(0, "only"))];
    assert!(
        store
            .append_and_finish(&key("r2"), last, &ok, Some("answer".into()))
            .await
            .unwrap()
    );
    let turn = store.get_turn(&key("r2")).await.unwrap().unwrap();
    assert_eq!(turn.state, TurnState::Completed);
    assert_eq!(
        store
            .events_after(&key("r2"), None, 10)
            .await
            .unwrap()
            .len(),
        1
    );
}

/// A run whose turn was failed by another replica's sweep (its lease ran
/// out, say while its renewals waited) and which finishes before its next
/// renewal would notice ends as the turn was recorded, UNAVAILABLE, not
/// OK: its caller and a replay agree.
async fn a_run_that_finishes_after_its_turn_was_failed_ends_as_recorded(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(
        store.clone(),
        Opts {
            // The first renewal is 20 s away; the tool takes 1 s.
            lease: Duration::from_secs(60),
            tool_delay: Duration::from_secs(1),
            ..Opts::default()
        },
    )
    .await;
    let sid = s.session(ALICE).await;
    let mut call = s
        .client
        .clone()
        .run(
            run_request(ALICE, &sid, "r1", ORDER_Q),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    let first = call.events.message().await.unwrap().unwrap();
    assert_eq!(first.seq, 0);
    let key = TurnKey {
        session_id: SessionId::parse(&sid).unwrap(),
        request_id: RequestId::parse("r1").unwrap(),
    };
    eventually("the tool call is stored", || {
        let (store, key) = (store.clone(), key.clone());
        async move { (store.events_after(&key, None, 10).await.unwrap().len() == 1).then_some(()) }
    })
    .await;
    // The lease lapses, and another replica's sweep finds it so.
    lapse_and_sweep(&*store, &key).await;
    let (_, end) = collect(&mut call.events).await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("replica stopped"), "{status:?}");
    let (replayed, again) = s.attach(ALICE, &sid, "r1", None).await.unwrap();
    assert_eq!(again.unwrap_err().code(), Code::Unavailable);
    assert_eq!(
        seqs(&replayed),
        [0],
        "the log ends where the turn was failed"
    );
    s.stop().await;
}

/// A replay whose turn is pruned (or its session deleted) while it streams
/// ends NOT_FOUND, saying so, not INTERNAL; and not marked recorded.
async fn a_replay_whose_turn_is_pruned_meanwhile_ends_not_found(db: TestDb) {
    let store = db.open().await;
    let s = Server::start(store.clone(), Opts::default()).await;
    let sid = s.session(ALICE).await;
    let req = pb::RunRequest {
        agent: "stream".into(),
        ..run_request(ALICE, &sid, "r1", "n=50000 size=100")
    };
    let (_, end) = s
        .client
        .clone()
        .run_to_end(req, Duration::from_secs(60))
        .await
        .unwrap();
    end.unwrap();
    let mut replay = s
        .raw()
        .attach(pb::AttachRequest {
            user_id: ALICE.into(),
            session_id: sid.clone(),
            request_id: "r1".into(),
            after_seq: None,
        })
        .await
        .unwrap()
        .into_inner();
    // Its reader has taken one event; the rest (5 MB) wait on it.
    replay.message().await.unwrap().unwrap();
    let later = SystemTime::now() + Duration::from_secs(3600);
    assert_eq!(store.prune(later, 10).await.unwrap(), 1);
    let (_, end) = collect(&mut replay).await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(status.message().contains("removed"), "{status:?}");
    assert!(status.metadata().get("agentd-turn-outcome").is_none());
    s.stop().await;
}

/// Each behaviour as a test on SQLite (module `$sqlite`) and on PostgreSQL
/// (module `$postgres`), on a runtime of two worker threads unless a flavor
/// comes first: `(flavor = "current_thread")` for a test that captures what
/// the server logs, whose tasks then run on the test's thread, under the
/// capture.
macro_rules! on_sqlite_and_postgres {
    ($sqlite:ident, $postgres:ident; $($name:ident),* $(,)?) => {
        on_sqlite_and_postgres!(
            (flavor = "multi_thread", worker_threads = 2) $sqlite, $postgres; $($name),*
        );
    };
    ($runtime:tt $sqlite:ident, $postgres:ident; $($name:ident),* $(,)?) => {
        mod $sqlite {
            $(#[tokio::test $runtime]
            async fn $name() {
                super::$name(super::TestDb::fresh(super::Backend::Sqlite).await.unwrap()).await
            })*
        }
        mod $postgres {
            $(#[tokio::test $runtime]
            async fn $name() {
                if let Some(db) = super::TestDb::fresh(super::Backend::Postgres).await {
                    super::$name(db).await
                }
            })*
        }
    };
}

macro_rules! per_backend {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(super::TestDb::fresh(super::Backend::Memory).await.unwrap()).await
            })*
        }
        on_sqlite_and_postgres!(sqlite, postgres; $($name),*);
    };
}

per_backend!(
    pruning_deletes_a_bounded_batch_of_the_oldest_ended_turns_with_their_events,
    a_session_is_not_deleted_under_a_running_turn_even_one_claimed_during_the_delete,
    a_run_whose_lease_was_lost_stops_and_ends_as_recorded,
    a_run_whose_task_panics_ends_internal_not_ok,
    a_turn_pruned_by_a_full_batch_leaves_the_history_a_run_reads,
    sessions_left_with_no_turns_are_pruned_oldest_first,
    an_unused_session_is_deleted_past_the_session_retention,
    a_nul_character_is_refused_in_a_question_and_kept_out_of_the_stored_history,
    a_final_answers_payload_and_agent_come_back_in_the_next_runs_history,
    a_runs_read_tells_whether_its_turn_is_stored,
    reads_made_together_each_get_their_own_session_and_history,
    the_history_a_run_reads_follows_every_change_to_its_session,
    every_store_call_is_timed_and_a_failure_counted,
    appends_of_many_turns_at_once_are_all_stored_and_a_bad_one_fails_alone,
    claims_made_together_each_win_once_and_a_bad_one_fails_alone,
    turns_ending_together_store_their_last_events_and_outcomes,
    sessions_are_listed_per_user_oldest_first_a_page_at_a_time,
    get_session_lists_each_turn_with_its_final_status,
    a_foreign_or_unknown_session_is_not_found_on_every_call,
    a_repeated_request_id_replays_the_stored_turn_without_running_the_tool_again,
    a_follow_up_turn_remembers_the_order_from_the_stored_history,
    attach_after_a_seq_streams_the_rest_then_the_final_status,
    a_continued_run_outlives_its_client_and_can_be_attached_later,
    a_run_whose_client_leaves_is_cancelled_by_default_and_replays_cancelled,
    delete_session_removes_it_with_its_turns_but_not_while_a_turn_runs,
    a_turn_whose_replica_stopped_renewing_its_lease_ends_unavailable_and_is_never_run,
    finished_turns_are_pruned_after_the_retention,
    bad_input_to_the_session_calls_is_invalid_argument_and_changes_nothing,
    the_turn_claim_is_exclusive_and_leases_belong_to_their_owner,
    the_event_log_reads_back_in_seq_order_across_commits_of_any_size,
    a_turn_failed_under_its_writer_keeps_the_log_and_outcome_it_ended_with,
    a_run_that_finishes_after_its_turn_was_failed_ends_as_recorded,
    get_session_pages_through_every_turn_oldest_first,
    get_session_with_text_returns_each_turns_question_and_answer_a_bounded_page_at_a_time,
    a_page_of_turn_texts_is_cut_by_bytes_and_says_whether_more_follow,
    a_create_session_repeated_with_its_request_id_answers_the_session_it_made,
    a_replay_whose_turn_is_pruned_meanwhile_ends_not_found,
);

/// A claim that waited for the database longer than its lease is stored
/// with a live lease: counted from its commit, not from its call.
async fn a_claim_that_waited_longer_than_its_lease_is_stored_with_it_live(db: TestDb) {
    let store = db.open().await;
    let sid = alice_session(&*store).await.id;
    let key = TurnKey {
        session_id: sid,
        request_id: RequestId::parse("r1").unwrap(),
    };
    let held = db.hold_writes().await;
    let claim = tokio::spawn({
        let (store, turn) = (
            store.clone(),
            NewTurn {
                lease: Duration::from_secs(1),
                ..new_turn(&key, "replica-a")
            },
        );
        async move { store.claim_turn(&turn).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    held.release().await;
    assert_eq!(claim.await.unwrap().unwrap(), agentd::store::Claim::New);
    let swept = store
        .fail_expired(&agentd::grpc::status::replica_stopped())
        .await
        .unwrap();
    assert!(swept.is_empty(), "the new turn's lease is live");
}

/// A database a later release migrated (a rollback, or an older replica
/// started during a rollout) is served, its extra migrations left alone.
async fn a_database_migrated_by_a_later_release_is_served(db: TestDb) {
    use sqlx::Connection as _;
    drop(db.open().await);
    let insert = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
                  VALUES (99990001, 'a later release', true, $1, 1)";
    let checksum = vec![7u8; 48];
    match db.backend {
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
            sqlx::query(insert)
                .bind(checksum)
                .execute(&mut c)
                .await
                .unwrap();
        }
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query(insert)
                .bind(checksum)
                .execute(&mut c)
                .await
                .unwrap();
        }
        Backend::Memory => unreachable!("no migrations"),
    }
    let store = agentd::store::open(&db.url)
        .await
        .expect("the store opens on a database a later release migrated");
    alice_session(&*store).await;
}

fn a2a_task(id: &str, state: a2a::TaskState) -> a2a::Task {
    a2a::Task {
        id: id.into(),
        context_id: format!("ctx-{id}"),
        status: a2a::TaskStatus {
            state,
            message: None,
            timestamp: Some(chrono::Utc::now()),
        },
        artifacts: None,
        history: None,
        metadata: None,
    }
}

/// Retention prunes A2A tasks that ended and were last updated before the
/// cut-off, oldest first and a bounded batch at a time; a task still working
/// stays whatever its age.
async fn a2a_tasks_that_ended_are_pruned_after_the_retention(db: TestDb) {
    use a2a::TaskState;
    let store = db.open().await;
    let tasks = store.a2a_tasks();
    let owner = UserId::parse(ALICE).unwrap();
    let task = a2a_task;
    for (id, state) in [
        ("done-1", TaskState::Completed),
        ("done-2", TaskState::Failed),
        ("done-3", TaskState::Canceled),
        ("working", TaskState::Working),
    ] {
        tasks.create_for(&owner, task(id, state)).await.unwrap();
    }
    let earlier = SystemTime::now() - Duration::from_secs(3600);
    assert_eq!(
        tasks.prune_ended(earlier, 10).await.unwrap(),
        0,
        "none is that old"
    );
    let later = SystemTime::now() + Duration::from_secs(1);
    assert_eq!(
        tasks.prune_ended(later, 2).await.unwrap(),
        2,
        "a bounded batch"
    );
    assert_eq!(tasks.prune_ended(later, 2).await.unwrap(), 1);
    assert_eq!(tasks.prune_ended(later, 2).await.unwrap(), 0);
    for id in ["done-1", "done-2", "done-3"] {
        assert!(tasks.get(id).await.unwrap().is_none(), "{id} pruned");
    }
    assert!(tasks.get("working").await.unwrap().is_some());
}

on_sqlite_and_postgres!(
    durable_sqlite,
    durable_postgres;
    a2a_tasks_that_ended_are_pruned_after_the_retention,
    a_claim_that_waited_longer_than_its_lease_is_stored_with_it_live,
    a_retry_sent_while_an_abandoned_claim_is_withdrawn_runs_the_turn_or_may_retry,
    a_claim_answered_but_never_read_is_removed,
    a_database_migrated_by_a_later_release_is_served,
);

on_sqlite_and_postgres!(
    (flavor = "current_thread")
    logged_sqlite,
    logged_postgres;
    a_caller_gone_during_its_claim_leaves_nothing_and_a_retry_runs_the_turn,
);
