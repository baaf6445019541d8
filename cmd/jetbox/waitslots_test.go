package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go/jetstream"
)

// slowStandby starts a streaming standby of f's primary (physical slot
// standby1) whose replication connection runs through a proxy, which the
// test can delay or pause; on 17+ the primary does not wait for it itself.
func slowStandby(t *testing.T, f *fixture) (*testenv.Postgres, *testenv.Proxy) {
	t.Helper()
	proxy := testenv.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", f.pg.Port()))
	sb := testenv.StartStandby(t, f.pg, fmt.Sprintf("primary_conninfo=host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=standby1", proxy.Port()),
		"wal_receiver_status_interval=1s")
	if f.pg.Major(t) >= 17 {
		// StartStandby makes the primary wait for the standby itself
		// (synchronized_standby_slots): these tests measure jetbox's wait.
		f.pg.Exec(t, "ALTER SYSTEM SET synchronized_standby_slots = ''")
		f.pg.Exec(t, "SELECT pg_reload_conf()")
	}
	return sb, proxy
}

// flushWatch consumes the stream as jetbox publishes and, for each message
// as it arrives, reads on the standby the WAL it has received and flushed
// (pg_last_wal_receive_lsn): a message whose commit record the standby had
// not flushed by then is one a promotion of it could lack.
type flushWatch struct {
	mu      sync.Mutex
	seen    int
	early   []string // messages that arrived before the standby flushed their commit
	lastErr error
}

func watchStandbyFlush(t *testing.T, js jetstream.JetStream, sb *testenv.Postgres) *flushWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w := &flushWatch{}
	var cons jetstream.Consumer
	testenv.WaitFor(t, 30*time.Second, func() error { // jetbox creates the stream
		var err error
		cons, err = js.OrderedConsumer(ctx, "OUTBOX", jetstream.OrderedConsumerConfig{})
		return err
	})
	conn, err := pgx.Connect(ctx, sb.DSN)
	must(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	cc, err := cons.Consume(func(m jetstream.Msg) {
		commit, err := pglogrepl.ParseLSN(m.Headers().Get("Jetbox-Commit-LSN"))
		var flushed string
		if err == nil {
			err = conn.QueryRow(ctx, "SELECT pg_last_wal_receive_lsn()::text").Scan(&flushed)
		}
		var f pglogrepl.LSN
		if err == nil {
			f, err = pglogrepl.ParseLSN(flushed)
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		w.seen++
		if err != nil {
			w.lastErr = err
			return
		}
		if f <= commit {
			w.early = append(w.early, fmt.Sprintf("%s (commit %s, standby flushed %s)", m.Headers().Get("Nats-Msg-Id"), commit, f))
		}
	})
	must(t, err)
	t.Cleanup(cc.Stop)
	return w
}

func (w *flushWatch) result() (seen int, early []string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.seen, append([]string(nil), w.early...), w.lastErr
}

// waitSeen waits until the watch has seen n messages.
func (w *flushWatch) waitSeen(t *testing.T, n int) {
	t.Helper()
	testenv.WaitFor(t, time.Minute, func() error {
		if seen, _, err := w.result(); err != nil {
			t.Fatalf("reading the standby: %v", err)
		} else if seen < n {
			return fmt.Errorf("%d of %d messages seen", seen, n)
		}
		return nil
	})
}

// TestWaitForStandbySlotsFlushedFirst: the standby's replication link is
// delayed by 30 ms each way. Without --wait-for-standby-slots jetbox
// publishes transactions the standby has not flushed yet (the watch sees
// them: the oracle can fail); with it, every message arrives only after the
// standby flushed its transaction's commit.
func TestWaitForStandbySlotsFlushedFirst(t *testing.T) {
	testenv.SkipIfShort(t)
	f := newFixture(t)
	sb, proxy := slowStandby(t, f)
	proxy.Delay(30 * time.Millisecond)
	conn := f.conn()

	p := f.start()
	f.waitStreaming(p)
	w := watchStandbyFlush(t, f.js, sb)
	var want []string
	for i := 0; i < 20; i++ {
		want = append(want, f.insertTx(conn, fmt.Sprintf("a%d", i), 3)...)
	}
	w.waitSeen(t, len(want))
	_, early, _ := w.result()
	if len(early) == 0 {
		t.Fatal("without --wait-for-standby-slots every message still arrived after the standby flushed it: the delay does not make the standby lag, so the test proves nothing")
	}
	t.Logf("without the flag: %d of %d messages arrived before the standby flushed their commit, e.g. %s", len(early), len(want), early[0])
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
	f.waitSlotReleased()

	p = f.start("JETBOX_WAIT_FOR_STANDBY_SLOTS=standby1")
	f.waitStreaming(p)
	before := len(want)
	// Two writers at once, so that transactions queue behind a wait.
	var wg sync.WaitGroup
	written := make([][]string, 2)
	for wr := range written {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := f.pg.Conn(t)
			defer c.Close(context.Background())
			for i := 0; i < 30; i++ {
				written[wr] = append(written[wr], f.insertTx(c, fmt.Sprintf("w%d-%d", wr, i), 1+i%4)...)
			}
		}()
	}
	wg.Wait()
	all := append(append([]string(nil), written[0]...), written[1]...)
	w.waitSeen(t, before+len(all))
	seen, early2, err := w.result()
	must(t, err)
	if late := early2[len(early):]; len(late) > 0 {
		t.Fatalf("with --wait-for-standby-slots, %d of %d messages arrived before the standby flushed their commit: %s", len(late), seen-before, strings.Join(late[:min(5, len(late))], "; "))
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
	got := testenv.ReadStream(t, f.js, "OUTBOX", false)
	if len(got) != before+len(all) {
		t.Fatalf("stream holds %d messages, want %d", len(got), before+len(all))
	}
	assertIDs(t, got[:before], want)
	stored := map[string]int{}
	for _, m := range got[before:] {
		stored[m.ID]++
	}
	for _, id := range all {
		if stored[id] != 1 {
			t.Fatalf("row %s stored %d times", id, stored[id])
		}
	}
}

// standbySlotFlush reads physical slot standby1's restart_lsn on the primary.
func standbySlotFlush(t *testing.T, f *fixture) pglogrepl.LSN {
	t.Helper()
	var s string
	must(t, f.conn().QueryRow(ctxT(t, 5*time.Second), "SELECT coalesce(restart_lsn, '0/0')::text FROM pg_replication_slots WHERE slot_name = 'standby1'").Scan(&s))
	l, err := pglogrepl.ParseLSN(s)
	must(t, err)
	return l
}

// TestWaitForStandbySlotsStandbyDown: the standby is stopped while rows
// are written. jetbox publishes nothing past what the standby flushed; after
// --standby-slot-timeout the log, jetbox_standby_slot_waiting and /readyz
// say it waits; once the standby is back every row arrives, once, in
// commit order, and the warning clears. Then, with
// --on-standby-slot-timeout=publish, a stopped standby holds rows back only
// for the timeout, jetbox_standby_slot_unguarded says so, and the guarantee
// comes back with the standby.
func TestWaitForStandbySlotsStandbyDown(t *testing.T) {
	testenv.SkipIfShort(t)
	f := newFixture(t)
	sb, _ := slowStandby(t, f)
	conn := f.conn()
	addr := httpAddr(t)
	p := f.start("JETBOX_WAIT_FOR_STANDBY_SLOTS=standby1", "JETBOX_STANDBY_SLOT_TIMEOUT=1s", "JETBOX_HTTP_ADDR="+addr)
	f.waitStreaming(p)
	want := f.insertTx(conn, "before", 5)
	f.waitCount(len(want), time.Minute)

	sb.Stop("fast")
	frozen := standbySlotFlush(t, f)
	for i := 0; i < 10; i++ {
		want = append(want, f.insertTx(conn, fmt.Sprintf("down%d", i), 3)...)
	}
	testenv.WaitFor(t, 30*time.Second, func() error {
		if m := scrape(t, addr); m["jetbox_standby_slot_waiting"] != 1 {
			return fmt.Errorf("jetbox_standby_slot_waiting = %v", m["jetbox_standby_slot_waiting"])
		}
		return nil
	})
	code, r := getReady(t, addr)
	if code != 200 || !strings.Contains(strings.Join(r.Warnings, "\n"), "publishing waits for the standbys") ||
		!strings.Contains(strings.Join(r.Warnings, "\n"), `slot "standby1" flushed`) {
		t.Fatalf("/readyz %d %+v: want ready, warning that publishing waits for slot standby1", code, r)
	}
	if !strings.Contains(p.logText(), "publishing waits for them") {
		t.Fatalf("no warning in the log:\n%s", p.tail(4096))
	}
	if m := scrape(t, addr); m[`jetbox_standby_slot_lag_bytes{slot="standby1"}`] <= 0 {
		t.Fatalf("jetbox_standby_slot_lag_bytes{slot=\"standby1\"} = %v while the standby is down", m[`jetbox_standby_slot_lag_bytes{slot="standby1"}`])
	}
	// Nothing past the standby's flush was published.
	for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", true) {
		if c, err := pglogrepl.ParseLSN(m.Header.Get("Jetbox-Commit-LSN")); err != nil || c >= frozen {
			t.Fatalf("message %s (commit %s) published while the standby, stopped, had flushed up to %s", m.ID, m.Header.Get("Jetbox-Commit-LSN"), frozen)
		}
	}

	sb.Start()
	f.waitCount(len(want), time.Minute)
	f.assertStream(want)
	testenv.WaitFor(t, 30*time.Second, func() error {
		if m := scrape(t, addr); m["jetbox_standby_slot_waiting"] != 0 {
			return fmt.Errorf("jetbox_standby_slot_waiting = %v", m["jetbox_standby_slot_waiting"])
		}
		if _, r := getReady(t, addr); len(r.Warnings) > 0 {
			return fmt.Errorf("/readyz warnings %q", r.Warnings)
		}
		return nil
	})
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
	f.waitSlotReleased()

	// --on-standby-slot-timeout=publish.
	p = f.start("JETBOX_WAIT_FOR_STANDBY_SLOTS=standby1", "JETBOX_STANDBY_SLOT_TIMEOUT=1s", "JETBOX_ON_STANDBY_SLOT_TIMEOUT=publish", "JETBOX_HTTP_ADDR="+addr)
	f.waitStreaming(p)
	sb.Stop("fast")
	want = append(want, f.insertTx(conn, "unguarded", 3)...)
	f.waitCount(len(want), time.Minute)
	if m := scrape(t, addr); m["jetbox_standby_slot_unguarded"] != 1 {
		t.Fatalf("jetbox_standby_slot_unguarded = %v after publishing without the standby", m["jetbox_standby_slot_unguarded"])
	}
	if _, r := getReady(t, addr); !strings.Contains(strings.Join(r.Warnings, "\n"), "publishing without waiting for the standbys") {
		t.Fatalf("/readyz warnings %q: want the unguarded warning", r.Warnings)
	}
	sb.Start()
	testenv.WaitFor(t, time.Minute, func() error {
		want = append(want, f.insertTx(conn, "back", 1)...) // the gate rechecks as transactions pass
		if m := scrape(t, addr); m["jetbox_standby_slot_unguarded"] != 0 {
			return fmt.Errorf("jetbox_standby_slot_unguarded = %v", m["jetbox_standby_slot_unguarded"])
		}
		return nil
	})
	f.waitCount(len(want), time.Minute)
	f.assertStream(want)
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
}

// TestWaitForStandbySlotsSetupProblems: a named slot that does not exist
// and one that is logical are reported together, with their fixes, by
// jetbox check and at start (exit 2, nothing streamed).
func TestWaitForStandbySlotsSetupProblems(t *testing.T) {
	testenv.SkipIfShort(t)
	f := newFixture(t)
	f.pg.Exec(t, "SELECT pg_create_logical_replication_slot('not_a_standby', 'pgoutput')")
	var out, errOut bytes.Buffer
	code := realMain([]string{"check", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.natURL, "--wait-for-standby-slots=nosuch,not_a_standby"}, &out, &errOut)
	text := out.String() + errOut.String()
	if code == exitOK {
		t.Fatalf("check passed with a missing and a logical slot:\n%s", text)
	}
	for _, want := range []string{`slot "nosuch", which does not exist`, "pg_create_physical_replication_slot('nosuch', true)",
		`slot "not_a_standby", a logical slot`} {
		if !strings.Contains(text, want) {
			t.Fatalf("check output lacks %q:\n%s", want, text)
		}
	}
	// A role without pg_read_all_stats cannot see the walsender's sent_lsn.
	f.pg.Exec(t, "SELECT pg_create_physical_replication_slot('phys1', true)")
	f.pg.Exec(t, "CREATE ROLE plain LOGIN REPLICATION")
	plainURL := fmt.Sprintf("postgres://plain@127.0.0.1:%d/postgres?sslmode=disable", f.pg.Port())
	for _, grant := range []bool{false, true} {
		if grant {
			f.pg.Exec(t, "GRANT pg_read_all_stats TO plain")
		}
		out.Reset()
		errOut.Reset()
		realMain([]string{"check", "--postgres-url=" + plainURL, "--nats-url=" + f.natURL, "--wait-for-standby-slots=phys1"}, &out, &errOut)
		text := out.String() + errOut.String()
		if has := strings.Contains(text, `GRANT pg_read_all_stats TO "plain"`); has == grant {
			t.Fatalf("granted %v: check output mentions the grant: %v:\n%s", grant, has, text)
		}
		if !strings.Contains(text, "only once the standbys of phys1 flushed it") {
			t.Fatalf("check output does not list phys1:\n%s", text)
		}
		// 17+: the server's own setting does it.
		if hint := strings.Contains(text, "ALTER SYSTEM SET synchronized_standby_slots = 'phys1'"); hint != (f.pg.Major(t) >= 17) {
			t.Fatalf("PostgreSQL %d: check hints at synchronized_standby_slots: %v:\n%s", f.pg.Major(t), hint, text)
		}
	}

	p := f.start("JETBOX_WAIT_FOR_STANDBY_SLOTS=nosuch,not_a_standby")
	if code := p.wait(time.Minute); code != exitConfig {
		t.Fatalf("exit %d, want %d:\n%s", code, exitConfig, p.tail(4096))
	}
	log := p.logText()
	for _, want := range []string{`slot \"nosuch\", which does not exist`, `slot \"not_a_standby\", a logical slot`} {
		if !strings.Contains(log, want) {
			t.Fatalf("start-up log lacks %q:\n%s", want, p.tail(4096))
		}
	}
}

// TestWaitForStandbySlotsRepair: a repair (jetbox repair, and so the
// automatic one) with --wait-for-standby-slots publishes nothing until the
// named standby has flushed its snapshot's consistent point: with the
// standby stopped it waits (warning after the timeout), and once the
// standby is back every row reaches the stream once.
func TestWaitForStandbySlotsRepair(t *testing.T) {
	testenv.SkipIfShort(t)
	f := newFixture(t)
	sb, _ := slowStandby(t, f)
	o := lostSlotBacklog(f, 300)
	sb.Stop("fast")
	rp := f.startCmd([]string{"repair"}, "JETBOX_WAIT_FOR_STANDBY_SLOTS=standby1", "JETBOX_STANDBY_SLOT_TIMEOUT=1s")
	testenv.WaitFor(t, time.Minute, func() error {
		select {
		case <-rp.done:
			t.Fatalf("jetbox repair exited with %d while the standby was down:\n%s", rp.code, rp.tail(4096))
		default:
		}
		if !strings.Contains(rp.logText(), "publishing waits for them") {
			return errors.New("the repair does not say yet that it waits for the standby")
		}
		return nil
	})
	if n, err := testenv.StreamCount(f.js, "OUTBOX"); err != nil || n != 10 {
		t.Fatalf("stream holds %d messages (%v) while the repair waits for the standby, want the 10 from before", n, err)
	}
	sb.Start()
	if code := rp.wait(2 * time.Minute); code != exitOK {
		t.Fatalf("jetbox repair exited with %d:\n%s", code, rp.tail(4096))
	}
	want := o.ids()
	f.waitCount(len(want), time.Minute)
	seen := map[string]bool{}
	for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", false) {
		if seen[m.ID] {
			t.Fatalf("id %s stored twice", m.ID)
		}
		seen[m.ID] = true
	}
	for _, id := range want {
		if !seen[id] {
			t.Fatalf("row %s not in the stream after the repair", id)
		}
	}
}
