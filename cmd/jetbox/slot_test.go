package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// currentLSN returns pg_current_wal_lsn().
func (f *fixture) currentLSN(conn *pgx.Conn) pglogrepl.LSN {
	f.t.Helper()
	var s string
	must(f.t, conn.QueryRow(ctxT(f.t, 10*time.Second), "SELECT pg_current_wal_lsn()::text").Scan(&s))
	l, err := pglogrepl.ParseLSN(s)
	must(f.t, err)
	return l
}

// TestIdleSlotRetainsNoWAL: with the outbox idle and other tables (and
// another database) busy, the slot's confirmed_flush_lsn keeps up with the
// server and the WAL it retains stays bounded.
func TestIdleSlotRetainsNoWAL(t *testing.T) {
	f := newFixture(t)
	p := f.start()
	f.waitStreaming(p)
	f.pg.Exec(t, "CREATE DATABASE neighbour")
	conn := f.conn()
	nconn, err := pgx.Connect(ctxT(t, 10*time.Second), strings.Replace(f.pg.DSN, "/postgres?", "/neighbour?", 1))
	must(t, err)
	defer nconn.Close(ctxT(t, 5*time.Second))
	_, err = nconn.Exec(ctxT(t, 10*time.Second), "CREATE TABLE busy (id bigserial, pad text)")
	must(t, err)

	ctx := ctxT(t, 5*time.Minute)
	for round := 0; round < 3; round++ {
		// ~48 MiB of WAL per round, none of it for the outbox.
		for i := 0; i < 4; i++ {
			_, err := conn.Exec(ctx, "INSERT INTO other (note) SELECT repeat('x', 1000) FROM generate_series(1, 3000)")
			must(t, err)
			_, err = nconn.Exec(ctx, "INSERT INTO busy (pad) SELECT repeat('y', 1000) FROM generate_series(1, 3000)")
			must(t, err)
		}
		_, err = conn.Exec(ctx, "SELECT pg_switch_wal()")
		must(t, err)
		target := f.currentLSN(conn)
		// The slot follows the server: confirmed_flush_lsn reaches target.
		testenv.WaitFor(t, time.Minute, func() error {
			lsn, _, err := f.slotState()
			if err != nil {
				return err
			}
			if lsn < target {
				return fmt.Errorf("confirmed_flush_lsn %s behind %s", lsn, target)
			}
			return nil
		})
		// And restart_lsn follows once a running-xacts record is decoded
		// (CHECKPOINT writes one): the slot pins no old WAL.
		_, err = conn.Exec(ctx, "CHECKPOINT")
		must(t, err)
		testenv.WaitFor(t, time.Minute, func() error {
			var retained int64
			if err := conn.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::text::pg_lsn, restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = 'jetbox'`,
				target.String()).Scan(&retained); err != nil {
				return err
			}
			if retained > 0 {
				return fmt.Errorf("slot retains %d bytes of WAL before %s", retained, target)
			}
			return nil
		})
	}
	var count uint64
	count, err = testenv.StreamCount(f.js, "OUTBOX")
	must(t, err)
	if count != 0 {
		t.Fatalf("%d messages published for an idle outbox", count)
	}
}

// TestNATSDownConfirmsNothingUnpublished: with NATS unreachable, the slot is
// never confirmed past the first unpublished transaction, however much
// unrelated WAL the server sends keepalives for, both while publishes hang
// (a blackholed connection: acks never come) and after they failed (the
// server stopped); then a crash and restart deliver everything.
func TestNATSDownConfirmsNothingUnpublished(t *testing.T) {
	runsBeside(t)
	for _, mode := range []string{"blackholed", "stopped"} {
		t.Run(mode, func(t *testing.T) {
			f := newFixture(t)
			o := f.newOracle()
			proxy := testenv.StartProxy(t, f.nats.URL[len("nats://"):])
			f.natURL = "nats://" + proxy.Addr
			p := f.start("JETBOX_STATUS_INTERVAL=200ms")
			f.waitStreaming(p)
			conn := f.conn()
			before := f.insertTx(conn, "before", 3)
			f.waitCount(3, 30*time.Second)

			if mode == "blackholed" {
				proxy.Pause()
			} else {
				f.nats.Stop()
			}
			var want []string
			for i := 0; i < 10; i++ {
				want = append(want, f.insertTx(conn, fmt.Sprintf("down-%d", i), 10)...)
			}
			firstEnd := o.endLSNOf(want[0])
			checkBelow := func() {
				t.Helper()
				lsn, _, err := f.slotState()
				must(t, err)
				if lsn >= firstEnd {
					t.Fatalf("confirmed_flush_lsn %s reached the end of the first unpublished transaction (%s)", lsn, firstEnd)
				}
			}
			checkBelow()
			f.unrelatedWAL(conn)
			checkBelow()

			p.kill()
			checkBelow()
			if mode == "blackholed" {
				proxy.Cut()
				proxy.Resume()
			} else {
				f.nats.Start()
			}
			p = f.start()
			all := append(before, want...)
			f.waitCount(len(all), time.Minute)
			f.assertStream(all)
			p.stop()
		})
	}
}

// unrelatedWAL writes WAL for a table outside the publication and waits until
// the walsender has sent keepalives past it and jetbox replied after that.
func (f *fixture) unrelatedWAL(conn *pgx.Conn) {
	f.t.Helper()
	ctx := ctxT(f.t, time.Minute)
	for i := 0; i < 3; i++ {
		_, err := conn.Exec(ctx, "INSERT INTO other (note) SELECT 'x' FROM generate_series(1, 1000)")
		must(f.t, err)
		_, err = conn.Exec(ctx, "SELECT pg_switch_wal()")
		must(f.t, err)
	}
	end := f.currentLSN(conn)
	since := time.Now()
	testenv.WaitFor(f.t, time.Minute, func() error {
		var sent string
		var reply time.Time
		err := conn.QueryRow(ctx, `SELECT coalesce(sent_lsn::text, '0/0'), coalesce(reply_time, 'epoch') FROM pg_stat_replication WHERE application_name = 'jetbox'`).Scan(&sent, &reply)
		if errors.Is(err, pgx.ErrNoRows) {
			return errors.New("jetbox not connected")
		}
		if err != nil {
			return err
		}
		s, _ := pglogrepl.ParseLSN(sent)
		if s < end || reply.Before(since.Add(500*time.Millisecond)) {
			return fmt.Errorf("walsender sent %s (want %s), last reply %s", s, end, reply)
		}
		return nil
	})
}

// endLSNOf returns the end LSN of the last transaction that inserted id (the
// LSN test_decoding reports for its COMMIT), from the oracle slot.
func (o *oracle) endLSNOf(id string) pglogrepl.LSN {
	o.f.t.Helper()
	rows, err := o.f.conn().Query(ctxT(o.f.t, time.Minute), "SELECT lsn::text, data FROM pg_logical_slot_peek_changes('oracle', NULL, NULL)")
	must(o.f.t, err)
	defer rows.Close()
	found, last := false, pglogrepl.LSN(0)
	for rows.Next() {
		var lsn, data string
		must(o.f.t, rows.Scan(&lsn, &data))
		if strings.Contains(data, "INSERT") && strings.Contains(data, id) {
			found = true
		}
		if found && strings.HasPrefix(data, "COMMIT") {
			l, err := pglogrepl.ParseLSN(lsn)
			must(o.f.t, err)
			found, last = false, l
		}
	}
	must(o.f.t, rows.Err())
	if last == 0 {
		o.f.t.Fatalf("no commit found for id %s", id)
	}
	return last
}

// lastCommitEnd returns the end LSN of the newest committed transaction.
func (o *oracle) lastCommitEnd() pglogrepl.LSN {
	o.f.t.Helper()
	var lsn string
	must(o.f.t, o.f.conn().QueryRow(ctxT(o.f.t, 5*time.Minute),
		"SELECT max(lsn)::text FROM pg_logical_slot_peek_changes('oracle', NULL, NULL) WHERE data LIKE 'COMMIT%'").Scan(&lsn))
	l, err := pglogrepl.ParseLSN(lsn)
	must(o.f.t, err)
	return l
}

// stoppedLine returns the fields of jetbox's final "stopped" log line.
func stoppedLine(t testing.TB, log string) map[string]any {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(log), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		var m map[string]any
		if json.Unmarshal([]byte(lines[i]), &m) == nil && m["message"] == "stopped" {
			return m
		}
	}
	t.Fatalf("no stopped line in log:\n%s", log)
	return nil
}

// TestCleanStop: SIGTERM waits for in-flight acks, confirms the end of the
// last transaction and exits 0, so the next start replays nothing.
func TestCleanStop(t *testing.T) {
	f := newFixture(t)
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	var want []string
	for i := 0; i < 3; i++ {
		want = append(want, f.insertTx(conn, "a", 50)...)
	}
	f.waitCount(len(want), 30*time.Second)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}
	lsn, active, err := f.slotState()
	must(t, err)
	// At (or past) the last transaction's end: Postgres will not send it again.
	if last := o.endLSNOf(want[len(want)-1]); active || lsn < last {
		t.Fatalf("after a clean stop: slot active=%v, confirmed %s, last transaction ends at %s", active, lsn, last)
	}
	p = f.start()
	f.waitStreaming(p)
	want = append(want, f.insertTx(conn, "b", 1)...)
	f.waitCount(len(want), 30*time.Second)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit code %d", code)
	}
	st := stoppedLine(t, p.logText())
	if st["duplicates"] != float64(0) || st["published"] != float64(1) {
		t.Fatalf("second run replayed: published %v duplicates %v (want 1 and 0)", st["published"], st["duplicates"])
	}
	f.assertStream(want)
}
