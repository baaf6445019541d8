package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// standbyFixture is a fixture whose primary has a streaming standby
// (hot_standby_feedback, physical slot standby1) and whose jetbox reads
// from the standby (--postgres-url), with --primary-url when withPrimary.
// The writers, the oracle (withOracle) and f.conn() use the primary. It skips before
// PostgreSQL 16, which cannot decode on a standby.
func standbyFixture(t *testing.T, withPrimary, withOracle bool) (*fixture, *oracle, *testenv.Postgres) {
	f := newFixture(t)
	if major := f.pg.Major(t); major < 16 {
		t.Skipf("PostgreSQL %d cannot decode on a standby (16+): run with JETBOX_PG_BINDIR=$(.ci/fetch-postgres 17)", major)
	}
	var o *oracle
	if withOracle { // before the standby: it gets a copy, for after a promotion
		o = f.newOracle()
	}
	sb := testenv.StartStandby(t, f.pg)
	f.pgURL = sb.DSN
	f.env = append(f.env, "JETBOX_STATUS_INTERVAL=500ms")
	if withPrimary {
		f.env = append(f.env, "JETBOX_PRIMARY_URL="+f.pg.DSN)
	}
	return f, o, sb
}

// waitStandbyStreaming waits until a walsender of the standby streams
// jetbox's slot.
func waitStandbyStreaming(t *testing.T, p *proc, sb *testenv.Postgres) {
	t.Helper()
	testenv.WaitFor(t, 2*time.Minute, func() error {
		select {
		case <-p.done:
			t.Fatalf("jetbox exited with %d before streaming:\n%s", p.code, p.tail(4096))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, sb.DSN)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		var active bool
		if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = 'jetbox')`).Scan(&active); err != nil {
			return err
		}
		if !active {
			return errors.New("the standby's slot is not streamed")
		}
		return nil
	})
}

// TestStandbyDecodingKilled (PostgreSQL 16+): jetbox decodes on a hot
// standby (--postgres-url) with --primary-url: it creates the publication
// on the primary and its slot on the standby, and sends heartbeats to the
// primary. Writers commit on the primary while jetbox is killed (kill -9)
// and restarted; the stream then holds every row once, in commit order.
func TestStandbyDecodingKilled(t *testing.T) {
	f, o, sb := standbyFixture(t, true, true)
	f.env = append(f.env, "JETBOX_HEARTBEAT_INTERVAL=1s")
	// jetbox check reports the set-up's prerequisites.
	var out, errOut bytes.Buffer
	if code := realMain([]string{"check", "--postgres-url=" + sb.DSN, "--primary-url=" + f.pg.DSN, "--nats-url=" + f.natURL}, &out, &errOut); code != exitOK {
		t.Fatalf("check: exit %d:\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"the server is a hot standby", "--primary-url reaches the primary (wal_level logical)", "jetbox run creates it on the primary"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("check output lacks %q:\n%s", want, out.String())
		}
	}
	p := f.start()
	waitStandbyStreaming(t, p, sb)
	var n int
	must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox'").Scan(&n))
	if n != 0 {
		t.Fatal("jetbox created its slot on the primary")
	}
	l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
	defer l.stop()
	f.progress(300, time.Minute)
	p.kill()
	f.progress(0, time.Second) // the stream is readable
	p = f.start()
	waitStandbyStreaming(t, p, sb)
	f.progress(1000, 2*time.Minute)
	f.finish(l, o)
	// The heartbeats went to the primary: its WAL holds them.
	conn := f.conn()
	testenv.WaitFor(t, 30*time.Second, func() error {
		var beats int
		if err := conn.QueryRow(ctxT(t, time.Minute), "SELECT count(*) FROM pg_logical_slot_peek_changes('oracle', NULL, NULL) WHERE data LIKE '%prefix: jetbox-heartbeat%'").Scan(&beats); err != nil {
			return err
		}
		if beats == 0 {
			return errors.New("no heartbeat in the primary's WAL")
		}
		return nil
	})
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
}

// waitPrimaryIdle waits until the primary has written nothing but a
// running-transactions record since its last other WAL (its background
// writer logs one after activity, then none while idle) and the standby
// has replayed it: a slot created on the standby now waits for a new one.
func waitPrimaryIdle(t *testing.T, f *fixture, sb *testenv.Postgres) {
	t.Helper()
	conn, sconn := f.conn(), sb.Conn(t)
	var from string
	must(t, conn.QueryRow(ctxT(t, 5*time.Second), "SELECT pg_current_wal_insert_lsn()::text").Scan(&from))
	f.pg.Exec(t, "CREATE EXTENSION IF NOT EXISTS pg_walinspect") // WAL after from
	testenv.WaitFor(t, time.Minute, func() error {
		var last, end string
		err := conn.QueryRow(ctxT(t, 5*time.Second), `SELECT coalesce((SELECT resource_manager || '/' || record_type
			FROM pg_get_wal_records_info($1::pg_lsn, pg_current_wal_flush_lsn()) ORDER BY start_lsn DESC LIMIT 1), ''),
			pg_current_wal_flush_lsn()::text`, from).Scan(&last, &end)
		if err != nil {
			return err
		}
		if last != "Standby/RUNNING_XACTS" {
			return fmt.Errorf("the primary's last WAL record is %q", last)
		}
		var replayed bool
		if err := sconn.QueryRow(ctxT(t, 5*time.Second), "SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn", end).Scan(&replayed); err != nil {
			return err
		}
		if !replayed {
			return errors.New("the standby has not replayed the primary's WAL")
		}
		return nil
	})
}

// TestStandbySlotCreationOnIdlePrimary (PostgreSQL 16+): on a standby of
// a primary that writes nothing, the slot's creation waits for a
// running-transactions record. Without --primary-url jetbox first refuses
// a missing publication (a standby cannot create it) with the statement to
// run on the primary, then gives up on the slot after --postgres-timeout
// (exit 2, naming --primary-url) and leaves no slot; with --primary-url it
// asks the primary for the record and streams at once.
func TestStandbySlotCreationOnIdlePrimary(t *testing.T) {
	f, _, sb := standbyFixture(t, false, false)
	f.env = append(f.env, "JETBOX_POSTGRES_TIMEOUT=10s")
	p := f.start()
	p.waitExit(exitConfig, `publication "jetbox" is missing, and the server is a standby`, "run on the primary: CREATE PUBLICATION")

	f.pg.Exec(t, "CREATE PUBLICATION jetbox FOR TABLE outbox WITH (publish = 'insert', publish_via_partition_root = true)")
	waitPrimaryIdle(t, f, sb)
	started := time.Now()
	p = f.start()
	p.waitExit(exitConfig, "waited 10s for the primary to log a running-transactions record", "set --primary-url", "pg_log_standby_snapshot()")
	took := time.Since(started)
	if took > 45*time.Second {
		t.Fatalf("the bounded wait took %s", took)
	}
	sconn := sb.Conn(t)
	testenv.WaitFor(t, 30*time.Second, func() error { // the cancelled creation's backend drops its slot as it ends
		var n int
		if err := sconn.QueryRow(ctxT(t, 5*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox'").Scan(&n); err != nil {
			return err
		}
		if n != 0 {
			return errors.New("the abandoned creation left a slot on the standby")
		}
		return nil
	})

	waitPrimaryIdle(t, f, sb)
	started = time.Now()
	p = f.start("JETBOX_PRIMARY_URL=" + f.pg.DSN)
	waitStandbyStreaming(t, p, sb)
	created := time.Since(started)
	id := f.insertOne(f.conn(), "S")
	f.waitCount(1, 30*time.Second)
	f.assertStream([]string{id})
	t.Logf("idle primary: without --primary-url refused after %s; with it, start to streaming on the standby in %s", took.Round(time.Millisecond), created.Round(time.Millisecond))
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
}

// TestStandbyPromotedUnderLoad (PostgreSQL 16+): jetbox decodes on a
// standby while writers commit on the primary (they follow whichever
// server accepts writes); the primary is killed and the standby promoted.
// jetbox's slot is on the promoted server already: jetbox goes on without
// exiting, and the stream equals the promoted server's outbox (its copy of
// the oracle slot, made before the standby), each row once, in commit
// order.
func TestStandbyPromotedUnderLoad(t *testing.T) {
	f, o, sb := standbyFixture(t, true, true)
	// Writers, the oracle and f.conn(): whichever server accepts writes.
	f.pg.DSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write", f.pg.Port(), sb.Port())
	p := f.start()
	waitStandbyStreaming(t, p, sb)
	l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
	defer l.stop()
	f.progress(500, time.Minute)
	promoted := failover(t, f, sb)
	goesOnOnNewTimeline(t, f, p, l, o, "the promotion")
	t.Logf("promotion (pg_promote asked) to the first event stored from the new timeline: %s", firstFromNewTimeline(t, f, promoted).Round(time.Millisecond))
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
}

// goesOnOnNewTimeline waits, while jetbox p keeps running, until the
// stream's last event comes from a timeline after the first, then stops
// the load l and checks the stream against the oracle o.
func goesOnOnNewTimeline(t *testing.T, f *fixture, p *proc, l *load, o *oracle, what string) {
	t.Helper()
	running := func() {
		select {
		case <-p.done:
			t.Fatalf("jetbox exited with %d after %s:\n%s", p.code, what, p.tail(4096))
		default:
		}
	}
	testenv.WaitFor(t, 2*time.Minute, func() error {
		running()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := f.js.Stream(ctx, "OUTBOX")
		if err != nil {
			return err
		}
		m, err := st.GetLastMsgForSubject(ctx, "outbox.>")
		if err != nil {
			return err
		}
		if src := m.Header.Get("Jetbox-Source"); strings.Split(src, "/")[1] == "1" {
			return fmt.Errorf("last event from %s", src)
		}
		return nil
	})
	f.progress(0, time.Minute)
	f.finish(l, o)
	running()
}

// TestStandbyFollowsPromotedStandby (PostgreSQL 16+): a cascading switch.
// jetbox decodes on standby1 of a primary that has a second standby,
// standby2. The writers pause and both standbys replay all the primary
// wrote (so that standby1 can follow standby2: a standby that replayed WAL
// the other lacks cannot); the primary stops, standby2 is promoted, and
// standby1 pointed at it (primary_conninfo, reloaded). PostgreSQL keeps the
// logical slot on standby1: a slot on a standby is not tied to its
// upstream, and standby1's replay follows standby2 onto the new timeline,
// through the same slot. jetbox goes on without exiting, its events from
// then on carry the new timeline, and the stream equals the promoted
// server's outbox (its copy of the oracle slot), each row once, in commit
// order.
func TestStandbyFollowsPromotedStandby(t *testing.T) {
	f, o, sb := standbyFixture(t, false, true)
	sb2 := testenv.StartNamedStandby(t, f.pg, "standby2")
	// Writers, the oracle, f.conn() and --primary-url: whichever server
	// accepts writes.
	f.pg.DSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write", f.pg.Port(), sb2.Port())
	f.env = append(f.env, "JETBOX_PRIMARY_URL="+f.pg.DSN)
	p := f.start()
	waitStandbyStreaming(t, p, sb)
	l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
	f.progress(300, time.Minute)
	l.stop()
	primary := f.conn()
	var end string
	must(t, primary.QueryRow(ctxT(t, 5*time.Second), "SELECT pg_current_wal_flush_lsn()::text").Scan(&end))
	for _, s := range []*testenv.Postgres{sb, sb2} {
		conn := s.Conn(t)
		testenv.WaitFor(t, time.Minute, func() error {
			var replayed bool
			if err := conn.QueryRow(ctxT(t, 5*time.Second), "SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn", end).Scan(&replayed); err != nil {
				return err
			}
			if !replayed {
				return fmt.Errorf("a standby has not replayed the primary's WAL up to %s", end)
			}
			return nil
		})
	}
	// A switchover: the primary's walsenders send both standbys all its
	// WAL, its shutdown checkpoint included, before it exits; a standby
	// that replayed WAL the other lacks could not follow it.
	f.pg.Stop("fast")
	sb2.Promote(t)
	sb.Exec(t, fmt.Sprintf("ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=standby1'", sb2.Port()))
	sb.Exec(t, "ALTER SYSTEM SET primary_slot_name = ''") // standby2 has no slot for it
	sb.Exec(t, "SELECT pg_reload_conf()")
	l = f.startLoad(3, 5*time.Millisecond, 1_000_000)
	defer l.stop()
	goesOnOnNewTimeline(t, f, p, l, o, "the switch of its standby's upstream")
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
}

// TestStandbySlotConflict (PostgreSQL 16+): a real conflict on the standby
// jetbox decodes on. The primary restarts with wal_level = replica; the
// standby replays the change and invalidates its logical slots. jetbox
// stops with the lost-slot error naming the conflict (exit 2), leaves the
// slot alone, and a restart refuses it the same way.
func TestStandbySlotConflict(t *testing.T) {
	f, _, sb := standbyFixture(t, true, false)
	p := f.start()
	waitStandbyStreaming(t, p, sb)
	f.insertTx(f.conn(), "before", 10)
	f.waitCount(10, time.Minute)
	f.pg.RestartWith("fast", "wal_level=replica", "max_wal_senders=20")
	want := []string{"is invalidated by a conflict with recovery on this standby", "jetbox repair"}
	p.waitExit(exitConfig, want...)
	var n int
	must(t, sb.Conn(t).QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox'").Scan(&n))
	if n != 1 {
		t.Fatalf("%d slots named jetbox on the standby, want the invalidated one left alone", n)
	}
	again := f.start()
	again.waitExit(exitConfig, want...)
}
