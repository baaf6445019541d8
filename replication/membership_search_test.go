package replication

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/rs/zerolog"
)

// searchCfg is the Config the search tests check: the default outbox, slot
// and publication "jetbox".
var searchCfg = Config{Slot: "jetbox", Publication: "jetbox", Decoder: decoder.Config{Schema: "public", Table: "outbox", Columns: decoder.DefaultColumns}}

// youngSlotWithBacklog sets up the start that once failed: slot "jetbox"
// created after another logical slot (so it inherits that slot's older
// catalog_xmin, older than the publication), never confirmed, and a
// backlog behind it, cut by a checkpoint (a running-transactions record)
// after its first rows. It returns the publication row's xmin.
func youngSlotWithBacklog(t *testing.T, pg *testenv.Postgres, conn *pgx.Conn) string {
	t.Helper()
	pg.Exec(t, "SELECT pg_create_logical_replication_slot('other', 'pgoutput')")
	pg.Exec(t, decoder.OutboxDDL+"; CREATE PUBLICATION jetbox FOR TABLE outbox")
	pg.Exec(t, "SELECT pg_create_logical_replication_slot('jetbox', 'pgoutput')")
	backlog := "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) SELECT 'a', g::text, 'E', jsonb_build_object('pad', repeat('x', 200)) FROM generate_series(1, 5000) g"
	pg.Exec(t, backlog)
	pg.Exec(t, "CHECKPOINT")
	for range 8 {
		pg.Exec(t, backlog)
	}
	var xmin string
	if err := conn.QueryRow(context.Background(), "SELECT xmin::text FROM pg_publication WHERE pubname = 'jetbox'").Scan(&xmin); err != nil {
		t.Fatal(err)
	}
	var newer bool
	if err := conn.QueryRow(context.Background(), "SELECT age($1::xid) <= age(catalog_xmin) FROM pg_replication_slots WHERE slot_name = 'jetbox'", xmin).Scan(&newer); err != nil {
		t.Fatal(err)
	}
	if !newer {
		t.Fatal("set-up: the publication is older than the new slot's catalog_xmin; the search would not run")
	}
	return xmin
}

// insertLSN returns the WAL's insert position: read after a catalog read,
// every commit that read saw is before it.
func insertLSN(t *testing.T, conn *pgx.Conn) pglogrepl.LSN {
	t.Helper()
	var s string
	if err := conn.QueryRow(context.Background(), "SELECT pg_current_wal_insert_lsn()::text").Scan(&s); err != nil {
		t.Fatal(err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		t.Fatal(err)
	}
	return lsn
}

// TestMembershipSearchStopsEarly: a young slot with a backlog (the start
// that timed out after a 3M-row backlog): the search places the
// publication's transaction before the slot's position by decoding up to
// the first running-transactions record, not the backlog, and the check
// passes. An xid newer than every transaction is never placed before it.
// With no running-transactions record after the position, the publication
// is placed before it at the end of the WAL (no commit after the position
// was its transaction's, nor one with an older xid).
func TestMembershipSearchStopsEarly(t *testing.T) {
	pg := testenv.StartPostgres(t)
	conn := pg.Conn(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	xmin := youngSlotWithBacklog(t, pg, conn)
	small := walSearch{Chunk: 256 << 10, Budget: func(int64) time.Duration { return time.Minute }}
	// An xid newer than every transaction (not yet assigned): each commit
	// after the position may be its top transaction's, so it is shadowed,
	// never placed before; it is looked for in the whole WAL.
	var future string
	if err := conn.QueryRow(ctx, "SELECT (pg_current_xact_id()::text::bigint + 1000)::text").Scan(&future); err != nil {
		t.Fatal(err)
	}
	pl, rep, err := placeSuspects(ctx, conn, "jetbox", []string{future}, insertLSN(t, conn), small)
	if err != nil {
		t.Fatal(err)
	}
	if !pl.Shadowed[future] || pl.Before[future] || pl.After[future] || rep.Early || rep.Searched != rep.Bytes || rep.Bytes < 4<<20 {
		t.Fatalf("an xid newer than all: %+v, %+v; want it shadowed, the whole WAL searched (over 4 MiB)", pl, rep)
	}

	pl, rep, err = placeSuspects(ctx, conn, "jetbox", []string{xmin}, insertLSN(t, conn), small)
	if err != nil {
		t.Fatal(err)
	}
	if !pl.Before[xmin] || pl.After[xmin] || !rep.Early || rep.Searched > rep.Bytes/2 {
		t.Fatalf("%+v, %+v; want the publication placed before the slot's position early", pl, rep)
	}
	t.Logf("placed early: %s", rep)

	fs, err := checkWith(ctx, pg.DSN, searchCfg, zerolog.Nop(), small)
	if err != nil {
		t.Fatal(err)
	}
	if check.Fatal(fs) {
		t.Fatalf("check of a young slot with a backlog failed: %+v", fs)
	}
	var searched []check.Finding
	for _, f := range check.Named(fs, "postgres.publication") {
		if strings.Contains(f.What, "searched the WAL") {
			searched = append(searched, f)
		}
	}
	if len(searched) != 1 || searched[0].Severity != check.Info {
		t.Fatalf("want one info finding on the search, got %+v", fs)
	}

	// A slot with no running-transactions record after its position (a
	// copy taken now of a slot confirmed to the end, then a few rows).
	pg.Exec(t, "SELECT pg_replication_slot_advance('jetbox', pg_current_wal_flush_lsn())")
	pg.Exec(t, "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', '1', 'E', '{}')")
	pl, rep, err = placeSuspects(ctx, conn, "jetbox", []string{xmin}, insertLSN(t, conn), small)
	if err != nil || !pl.Before[xmin] {
		t.Fatalf("after a few rows past the position: %+v, %+v, %v; want the publication placed before it", pl, rep, err)
	}
}

// TestMembershipSearchFreshSlot: the publication and then the slot created
// beside another logical slot (the new one inherits its older
// catalog_xmin), and the check run at once, before any running-transactions
// record after the slot's position: the search reaches the end with the
// publication neither found nor shadowed, and places it before.
func TestMembershipSearchFreshSlot(t *testing.T) {
	pg := testenv.StartPostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pg.Exec(t, "SELECT pg_create_logical_replication_slot('other', 'pgoutput')")
	pg.Exec(t, decoder.OutboxDDL+"; CREATE PUBLICATION jetbox FOR TABLE outbox")
	pg.Exec(t, "SELECT pg_create_logical_replication_slot('jetbox', 'pgoutput')")
	pg.Exec(t, "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', '1', 'E', '{}')")
	fs, err := checkWith(ctx, pg.DSN, searchCfg, zerolog.Nop(), defaultWALSearch)
	if err != nil {
		t.Fatal(err)
	}
	if check.Fatal(fs) {
		t.Fatalf("check of a fresh slot beside another one failed: %+v", fs)
	}
	if len(check.Named(fs, "postgres.publication")) < 2 {
		t.Fatalf("want the search's finding: %+v", fs)
	}
}

// TestMembershipSearchWaitsForFlush: the table re-added to the publication
// after the slot's position in an asynchronous commit, the search run at
// once, before the WAL writer flushed it (decoding reads only flushed WAL):
// the search waits for the WAL to be flushed up to what the catalog read
// saw, and finds the re-add, rather than reaching an end before it and
// placing it before the position.
func TestMembershipSearchWaitsForFlush(t *testing.T) {
	pg := testenv.StartPostgres(t)
	conn := pg.Conn(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pg.Exec(t, "ALTER SYSTEM SET wal_writer_delay = '3s'")
	pg.Exec(t, "SELECT pg_reload_conf()")
	pg.Exec(t, "SELECT pg_create_logical_replication_slot('other', 'pgoutput')")
	pg.Exec(t, decoder.OutboxDDL+"; CREATE PUBLICATION jetbox FOR TABLE outbox")
	pg.Exec(t, "SELECT pg_create_logical_replication_slot('jetbox', 'pgoutput')")
	pg.Exec(t, "SET synchronous_commit = off; BEGIN; ALTER PUBLICATION jetbox DROP TABLE outbox; ALTER PUBLICATION jetbox ADD TABLE outbox; COMMIT")
	var rel string
	var flushed bool
	if err := conn.QueryRow(ctx, "SELECT xmin::text, pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn() FROM pg_publication_rel").Scan(&rel, &flushed); err != nil {
		t.Fatal(err)
	}
	if flushed {
		t.Log("the WAL writer flushed the re-add before the search began: the wait is not exercised this run")
	}
	small := walSearch{Chunk: 256 << 10, Budget: func(int64) time.Duration { return time.Minute }}
	pl, rep, err := placeSuspects(ctx, conn, "jetbox", []string{rel}, insertLSN(t, conn), small)
	if err != nil || !pl.After[rel] || pl.Before[rel] {
		t.Fatalf("re-added in an asynchronous commit: %+v, %+v, %v; want it found after the slot's position", pl, rep, err)
	}
}

// refusals returns the publication findings that are not Info.
func refusals(fs []check.Finding) []check.Finding {
	var out []check.Finding
	for _, f := range check.Named(fs, "postgres.publication") {
		if f.Severity != check.Info {
			out = append(out, f)
		}
	}
	return out
}

// TestMembershipSearchFindsNewer: the table dropped from the publication and
// added back after the slot's position, behind a backlog: the search finds
// the re-adding transaction and the check refuses, naming it. Re-added
// inside a subtransaction (whose xid test_decoding does not print), it is
// not found, and not placed before the position either, though the copy's
// catalog_xmin passes it (its top transaction committed after the
// position): refused too.
func TestMembershipSearchFindsNewer(t *testing.T) {
	for _, sub := range []bool{false, true} {
		t.Run(map[bool]string{false: "top", true: "subtransaction"}[sub], func(t *testing.T) {
			pg := testenv.StartPostgres(t)
			conn := pg.Conn(t)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			youngSlotWithBacklog(t, pg, conn)
			pg.Exec(t, "CHECKPOINT")
			readd := "BEGIN; ALTER PUBLICATION jetbox DROP TABLE outbox; ALTER PUBLICATION jetbox ADD TABLE outbox; COMMIT"
			if sub {
				readd = "BEGIN; ALTER PUBLICATION jetbox DROP TABLE outbox; SAVEPOINT s; ALTER PUBLICATION jetbox ADD TABLE outbox; RELEASE s; COMMIT"
			}
			pg.Exec(t, readd)
			// Running-transactions records after the re-add, and WAL
			// enough after them for the search to go on past them: the
			// copy's catalog_xmin passes the re-add's xids there.
			for range 10 {
				pg.Exec(t, "CHECKPOINT")
				pg.Exec(t, "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) SELECT 'a', g::text, 'E', jsonb_build_object('pad', repeat('x', 200)) FROM generate_series(1, 3000) g")
			}
			var rel string
			if err := conn.QueryRow(ctx, "SELECT xmin::text FROM pg_publication_rel").Scan(&rel); err != nil {
				t.Fatal(err)
			}
			small := walSearch{Chunk: 256 << 10, Budget: func(int64) time.Duration { return time.Minute }}
			pl, rep, err := placeSuspects(ctx, conn, "jetbox", []string{rel}, insertLSN(t, conn), small)
			if err != nil || pl.Before[rel] || pl.After[rel] == sub || (sub && rep.Searched != rep.Bytes) {
				t.Fatalf("re-added after the slot's position: %+v, %+v, %v; want it not before, found after unless in a subtransaction", pl, rep, err)
			}
			fs, err := checkWith(ctx, pg.DSN, searchCfg, zerolog.Nop(), small)
			if err != nil {
				t.Fatal(err)
			}
			want := "committed after the slot's position (found in the WAL from there)"
			if sub {
				want = "inside a subtransaction"
			}
			got := refusals(fs)
			if len(got) != 1 || got[0].Severity != check.Error || !strings.Contains(got[0].What, want) {
				t.Fatalf("want the re-added membership refused (%q), got %+v", want, got)
			}
		})
	}
}

// TestMembershipSearchOutOfTime: a search that runs out of its budget is a
// refusal that says so (the membership cannot be placed), and it costs the
// other checks nothing: it ran on its own connection.
func TestMembershipSearchOutOfTime(t *testing.T) {
	pg := testenv.StartPostgres(t)
	conn := pg.Conn(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	youngSlotWithBacklog(t, pg, conn)
	none := walSearch{Chunk: 256 << 10, Budget: func(int64) time.Duration { return time.Millisecond }}
	fs, err := checkWith(ctx, pg.DSN, searchCfg, zerolog.Nop(), none)
	if err != nil {
		t.Fatal(err)
	}
	got := refusals(fs)
	if len(got) != 1 || got[0].Severity != check.Error || !strings.Contains(got[0].What, "could not be searched") || !strings.Contains(got[0].What, "budget") {
		t.Fatalf("want one refusal naming the search's budget, got %+v", got)
	}
	for _, f := range fs {
		if strings.Contains(f.What, "query failed") {
			t.Errorf("another check failed after the search ran out of time: %+v", f)
		}
	}
	if len(check.Named(fs, "postgres.failover")) != 1 {
		t.Errorf("the failover check, which runs after the search, did not report: %+v", fs)
	}
	// The temporary copy goes with its connection.
	testenv.WaitFor(t, 30*time.Second, func() error {
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'jetbox_probe_%'").Scan(&n); err != nil {
			return err
		}
		if n != 0 {
			return fmt.Errorf("%d probe slots left", n)
		}
		return nil
	})
}

// TestMembershipSearchOnStandby (16+): the search on a hot standby decodes
// up to the replayed WAL. The slot on the standby, the table re-added on
// the primary after the slot's position: once replayed, the check on the
// standby finds the re-add and refuses; the membership as it was at the
// slot's creation passes.
func TestMembershipSearchOnStandby(t *testing.T) {
	primary := testenv.StartPostgres(t)
	if major := primary.Major(t); major < 16 {
		t.Skipf("PostgreSQL %d cannot decode on a standby (16+): run with JETBOX_PG_BINDIR=$(.ci/fetch-postgres 17)", major)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary.Exec(t, decoder.OutboxDDL+"; CREATE PUBLICATION jetbox FOR TABLE outbox")
	standby := testenv.StartStandby(t, primary, "hot_standby_feedback=on")
	// Slot creation on a standby waits for a running-transactions record
	// from the primary.
	created := make(chan error, 1)
	go func() {
		_, err := standby.Conn(t).Exec(ctx, "SELECT pg_create_logical_replication_slot('jetbox', 'pgoutput')")
		created <- err
	}()
	testenv.WaitFor(t, time.Minute, func() error {
		primary.Exec(t, "SELECT pg_log_standby_snapshot()")
		select {
		case err := <-created:
			if err != nil {
				t.Fatal(err)
			}
			return nil
		case <-time.After(200 * time.Millisecond):
			return fmt.Errorf("slot not created on the standby yet")
		}
	})
	small := walSearch{Chunk: 256 << 10, Budget: func(int64) time.Duration { return time.Minute }}
	fs, err := checkWith(ctx, standby.DSN, searchCfg, zerolog.Nop(), small)
	if err != nil {
		t.Fatal(err)
	}
	if got := refusals(fs); len(got) != 0 {
		t.Fatalf("the membership from before the slot refused on the standby: %+v", got)
	}

	primary.Exec(t, "BEGIN; ALTER PUBLICATION jetbox DROP TABLE outbox; ALTER PUBLICATION jetbox ADD TABLE outbox; COMMIT")
	var rel string
	if err := primary.Conn(t).QueryRow(ctx, "SELECT xmin::text FROM pg_publication_rel").Scan(&rel); err != nil {
		t.Fatal(err)
	}
	sb := standby.Conn(t)
	testenv.WaitFor(t, time.Minute, func() error {
		var n int
		if err := sb.QueryRow(ctx, "SELECT count(*) FROM pg_publication_rel WHERE xmin::text = $1", rel).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("the re-add is not replayed yet")
		}
		return nil
	})
	fs, err = checkWith(ctx, standby.DSN, searchCfg, zerolog.Nop(), small)
	if err != nil {
		t.Fatal(err)
	}
	got := refusals(fs)
	if len(got) != 1 || !strings.Contains(got[0].What, "committed after the slot's position (found in the WAL from there)") {
		t.Fatalf("want the re-add found on the standby and refused, got %+v", got)
	}
}
