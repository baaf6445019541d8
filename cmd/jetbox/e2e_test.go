package main

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// TestEndToEndContent checks subject, data and every header of published
// messages against what Postgres stored.
func TestEndToEndContent(t *testing.T) {
	f := newFixture(t)
	p := f.start()
	f.waitStreaming(p)

	conn := f.conn()
	ctx := ctxT(t, time.Minute)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i, row := range []struct{ agg, ev, payload, headers string }{
		{"order", "OrderCreated", `{"z": 1, "big": 12345678901234567890, "a": [1, 2]}`, `{"traceparent": "00-abc-def-01", "n": null, "Tenant": "acme"}`},
		{"order", "OrderPaid", `{"amount": 12.50}`, ``},
		{"customer", "CustomerRenamed", `"just a string"`, `{}`},
	} {
		var id string
		var headers any
		if row.headers != "" {
			headers = row.headers
		}
		if err := tx.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
			VALUES ($1, $2, $3, $4::jsonb, $5::jsonb) RETURNING id::text`, row.agg, "agg-"+strconv.Itoa(i), row.ev, row.payload, headers).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	f.waitCount(3, 30*time.Second)

	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	assertIDs(t, msgs, ids)
	var lsn pglogrepl.LSN
	for i, m := range msgs {
		var payload, agg, aggID, ev, created string
		if err := conn.QueryRow(ctx, `SELECT payload::text, aggregate_type, aggregate_id, event_type, created_at::text FROM outbox WHERE id = $1`, ids[i]).
			Scan(&payload, &agg, &aggID, &ev, &created); err != nil {
			t.Fatal(err)
		}
		if want := "outbox." + agg + "." + ev; m.Subject != want {
			t.Errorf("msg %d subject %q, want %q", i, m.Subject, want)
		}
		if !bytes.Equal(m.Data, []byte(payload)) {
			t.Errorf("msg %d data %q, want Postgres' rendering %q", i, m.Data, payload)
		}
		h := m.Header
		for k, want := range map[string]string{
			"Nats-Msg-Id": ids[i], format.HeaderAggregateType: agg, format.HeaderAggregateID: aggID,
			format.HeaderEventType: ev, format.HeaderTxIndex: strconv.Itoa(i),
		} {
			if got := h.Get(k); got != want {
				t.Errorf("msg %d header %s = %q, want %q", i, k, got, want)
			}
		}
		l, err := pglogrepl.ParseLSN(h.Get(format.HeaderCommitLSN))
		if err != nil || l == 0 {
			t.Errorf("msg %d commit LSN %q: %v", i, h.Get(format.HeaderCommitLSN), err)
		}
		if i > 0 && l != lsn {
			t.Errorf("one transaction, two commit LSNs: %s and %s", lsn, l)
		}
		lsn = l
		ct, err := time.Parse(time.RFC3339Nano, h.Get(format.HeaderCommitTime))
		if err != nil || !strings.HasSuffix(h.Get(format.HeaderCommitTime), "Z") || len(h.Get(format.HeaderCommitTime)) != len(format.CommitTimeLayout)-5 {
			t.Errorf("msg %d commit time %q not RFC 3339 UTC with nanoseconds: %v", i, h.Get(format.HeaderCommitTime), err)
		}
		if time.Since(ct) > time.Minute || time.Until(ct) > time.Minute {
			t.Errorf("msg %d commit time %s is not now", i, ct)
		}
	}
	// jsonb renders big integers as digits, never as a float.
	if !bytes.Contains(msgs[0].Data, []byte("12345678901234567890")) {
		t.Errorf("big integer re-encoded: %s", msgs[0].Data)
	}
	// String values of the headers column become headers of the same name.
	if got := msgs[0].Header["traceparent"]; len(got) != 1 || got[0] != "00-abc-def-01" {
		t.Errorf("traceparent header = %q (all: %v)", got, msgs[0].Header)
	}
	if got := msgs[0].Header["Tenant"]; len(got) != 1 || got[0] != "acme" {
		t.Errorf("Tenant header = %q", got)
	}
	if _, ok := msgs[0].Header["n"]; ok {
		t.Errorf("non-string header value copied: %v", msgs[0].Header)
	}
	for _, m := range msgs[1:] {
		for k := range m.Header {
			if !strings.HasPrefix(k, "Nats-") && !strings.HasPrefix(k, "Jetbox-") {
				t.Errorf("row without headers carries header %q: %v", k, m.Header)
			}
		}
	}

	// The stream jetbox created has the documented shape.
	s, err := f.js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	if len(cfg.Subjects) != 1 || cfg.Subjects[0] != "outbox.>" || cfg.Storage.String() != "File" || cfg.Duplicates != 30*time.Minute {
		t.Errorf("stream config: subjects %v storage %v duplicates %v", cfg.Subjects, cfg.Storage, cfg.Duplicates)
	}
	if code := p.stop(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}
}

// TestOnlyInsertsPublish: rows inserted and deleted in one transaction are
// still published; updates, deletes and other tables publish nothing.
func TestOnlyInsertsPublish(t *testing.T) {
	f := newFixture(t)
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	ctx := ctxT(t, time.Minute)

	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var keepEmpty []string
	rows, _ := tx.Query(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', 'o'||g, 'OrderCreated', '{}' FROM generate_series(1,3) g RETURNING id::text`)
	for rows.Next() {
		var id string
		_ = rows.Scan(&id)
		keepEmpty = append(keepEmpty, id)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if _, err := tx.Exec(ctx, "DELETE FROM outbox"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	more := f.insertTx(conn, "o9", 2)
	for _, sql := range []string{
		"UPDATE outbox SET event_type = 'Changed'",
		"DELETE FROM outbox",
		"INSERT INTO other (note) SELECT 'x' FROM generate_series(1, 50)",
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	marker := f.insertTx(conn, "marker", 1) // once it is in, everything before it was decoded
	want := append(append(keepEmpty, more...), marker...)
	f.waitCount(len(want), 30*time.Second)
	f.assertStream(want)
}

// TestCommitOrder: transactions reach the stream in commit order, not insert
// order, and rows of a transaction in insert order.
func TestCommitOrder(t *testing.T) {
	f := newFixture(t)
	p := f.start()
	f.waitStreaming(p)
	ctx := ctxT(t, time.Minute)
	a, b := f.conn(), f.conn()
	txA, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	txB, err := b.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var idA1, idB, idA2 string
	ins := `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'E', '{}') RETURNING id::text`
	must(t, txA.QueryRow(ctx, ins, "a").Scan(&idA1))
	must(t, txB.QueryRow(ctx, ins, "b").Scan(&idB))
	must(t, txA.QueryRow(ctx, ins, "a").Scan(&idA2))
	must(t, txB.Commit(ctx)) // B inserted after A but commits first
	must(t, txA.Commit(ctx))
	f.waitCount(3, 30*time.Second)
	msgs := f.assertStream([]string{idB, idA1, idA2})
	_ = msgs
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
