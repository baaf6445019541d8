package main

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
)

// permissiveOutbox is an outbox without the README's constraints, so a test
// can commit every kind of bad row.
const permissiveOutbox = `CREATE TABLE public.outbox (
  id text, aggregate_type text, aggregate_id text, event_type text, payload jsonb, headers jsonb)`

// TestDeadLetters: with --on-invalid=dead-letter every kind of row that
// cannot be published becomes a dead letter on outbox._dlq.<reason>, in
// commit order between the good rows, with headers naming the reason, the
// row id, its LSN and the original subject; nothing is lost, nothing is
// stored twice after a SIGKILL, and each is counted in the metrics.
func TestDeadLetters(t *testing.T) {
	f := newFixture(t, withDDL(permissiveOutbox), withNATS(testenv.WithMaxPayload(16*1024)))
	p := f.start("JETBOX_ON_INVALID=dead-letter")
	f.waitStreaming(p) // the slot exists: rows committed from now on are streamed
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
	good := func(id string) string {
		return fmt.Sprintf(`INSERT INTO outbox VALUES ('%s', 'order', 'o-1', 'Created', '{"ok": true}', '{"traceparent": "00-1"}')`, id)
	}
	row := func(id, agg, aggID, ev, payload, headers string) string {
		return fmt.Sprintf(`INSERT INTO outbox VALUES (%s, %s, %s, %s, %s, %s)`, id, agg, aggID, ev, payload, headers)
	}
	cases := []struct {
		sql, reason, rowID string // reason "" = a good row
	}{
		{good("good-1"), "", "good-1"},
		{row("NULL", "'order'", "'1'", "'E'", "'{}'", "NULL"), format.ReasonBadID, ""},
		{row("''", "'order'", "'1'", "'E'", "'{}'", "NULL"), format.ReasonBadID, ""},
		{row("'r-null-payload'", "'order'", "'1'", "'E'", "NULL", "NULL"), format.ReasonNullPayload, "r-null-payload"},
		{row("'r-null-agg-id'", "'order'", "NULL", "'E'", "'{}'", "NULL"), format.ReasonNullColumn, "r-null-agg-id"},
		{row("'r-space'", "'big order'", "'1'", "'E'", "'{}'", "NULL"), format.ReasonBadSubject, "r-space"},
		{row("'r-dot'", "'order'", "'1'", "'a.b'", "'{}'", "NULL"), format.ReasonBadSubject, "r-dot"},
		{row("'r-star'", "'*'", "'1'", "'E'", "'{}'", "NULL"), format.ReasonBadSubject, "r-star"},
		{row("'r-gt'", "'order'", "'1'", "'>'", "'{}'", "NULL"), format.ReasonBadSubject, "r-gt"},
		{row("'r-empty-type'", "''", "'1'", "'E'", "'{}'", "NULL"), format.ReasonBadSubject, "r-empty-type"},
		{row("'r-control'", `E'or\x01der'`, "'1'", "'E'", "'{}'", "NULL"), format.ReasonBadSubject, "r-control"},
		{row("'r-crlf-agg-id'", "'order'", `E'1\r\n2'`, "'E'", "'{}'", "NULL"), format.ReasonBadAggregateID, "r-crlf-agg-id"},
		{row("'r-headers-array'", "'order'", "'1'", "'E'", "'{}'", `'[1]'`), format.ReasonBadHeaders, "r-headers-array"},
		{row("'r-headers-number'", "'order'", "'1'", "'E'", "'{}'", `'{"n": 1}'`), format.ReasonBadHeaders, "r-headers-number"},
		{row("'r-headers-reserved'", "'order'", "'1'", "'E'", "'{}'", `'{"Nats-Msg-Id": "x"}'`), format.ReasonBadHeaders, "r-headers-reserved"},
		// nats-server 2.10 finds its headers by text search (TestServerHeaderSearch in sink).
		{row("'r-header-name-nats'", "'order'", "'1'", "'E'", "'{}'", `'{"X-Nats-Msg-Id": "x"}'`), format.ReasonBadHeaders, "r-header-name-nats"},
		{row("'r-Nats-Expected-Last-Sequence'", "'order'", "'1'", "'E'", "'{}'", "NULL"), format.ReasonBadID, "r-Nats_Expected-Last-Sequence"}, // Jetbox-Row-Id escapes it
		{row("'r-big'", "'order'", "'1'", "'E'", `jsonb_build_object('pad', repeat('x', 20000))`, "NULL"), format.ReasonTooLarge, "r-big"},
		{good("good-2"), "", "good-2"},
		{good("good-1"), format.ReasonDuplicateID, "good-1"}, // repeats good-1, two rows back
		// Two rows of one transaction, the second repeating the first's id.
		{good("good-3") + "; " + good("good-3"), "", "good-3"},
		{"", format.ReasonDuplicateID, "good-3"}, // (the second row above)
		{good("good-4"), "", "good-4"},
	}
	for _, c := range cases {
		if c.sql != "" {
			f.pg.Exec(t, c.sql)
		}
	}
	// A long status interval: nothing is confirmed before the kill below,
	// so the restart replays every row and dead letter.
	addr := httpAddr(t)
	p = f.start("JETBOX_ON_INVALID=dead-letter", "JETBOX_HTTP_ADDR="+addr, "JETBOX_STATUS_INTERVAL=10s", "JETBOX_POSTGRES_TIMEOUT=60s")
	f.waitCount(len(cases), time.Minute)

	check := func() {
		msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
		if len(msgs) != len(cases) {
			t.Fatalf("%d messages, want %d; %s", len(msgs), len(cases), f.describeExtra())
		}
		for i, c := range cases {
			m := msgs[i]
			if c.reason == "" {
				if m.ID != c.rowID || m.Subject != "outbox.order.Created" || m.Header.Get("traceparent") != "00-1" {
					t.Fatalf("message %d: id %s subject %s, want good row %s", i, m.ID, m.Subject, c.rowID)
				}
				continue
			}
			h := m.Header
			if m.Subject != "outbox._dlq."+c.reason || h.Get(format.HeaderDeadLetterReason) != c.reason ||
				h.Get(format.HeaderRowID) != c.rowID || h.Get("Jetbox-Commit-LSN") == "" || !strings.HasPrefix(m.ID, "jetbox-dlq-") ||
				h.Get(format.HeaderTable) != "public.outbox" || !strings.Contains(h.Get(format.HeaderDeadLetterError), "transaction 0/") {
				t.Fatalf("message %d (%s): subject %s id %s headers %v", i, c.rowID, m.Subject, m.ID, h)
			}
			switch c.reason {
			case format.ReasonTooLarge:
				if h.Get(format.HeaderPayloadOmitted) != "true" || !strings.Contains(string(m.Data), `"id":"r-big"`) {
					t.Fatalf("too-large dead letter: headers %v data %.200s", h, m.Data)
				}
			case format.ReasonNullPayload:
			default:
				if len(m.Data) == 0 {
					t.Fatalf("message %d: dead letter lost the payload", i)
				}
			}
		}
	}
	check()
	counts := scrape(t, addr)
	if n := counts[`jetbox_invalid_rows_total{action="dead-letter",reason="bad-subject"}`]; n != 6 {
		t.Fatalf("jetbox_invalid_rows_total bad-subject = %v, want 6", n)
	}
	if n := counts[`jetbox_invalid_rows_total{action="dead-letter",reason="duplicate-id"}`]; n != 2 {
		t.Fatalf("jetbox_invalid_rows_total duplicate-id = %v, want 2", n)
	}

	// A crash and a replay from the slot store nothing twice.
	p.kill()
	p = f.start("JETBOX_ON_INVALID=dead-letter")
	f.waitStreaming(p)
	cases = append(cases, struct{ sql, reason, rowID string }{good("good-5"), "", "good-5"})
	f.pg.Exec(t, good("good-5"))
	f.waitCount(len(cases), time.Minute)
	check()
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
	if st := stoppedLine(t, p.logText()); st["duplicates"].(float64) < float64(len(cases)-1) {
		t.Fatalf("the restart replayed %v events, want all %d (the test did not test the replay)", st["duplicates"], len(cases)-1)
	}
}

// TestDeadLetteredRowReplayedUnderStop: a row dead-lettered by a run under
// --on-invalid=dead-letter, whose transaction the slot replays (jetbox was
// stopped before it confirmed it: here the slot is put back where it was
// before the rows, from a copy), is skipped by a restart under
// --on-invalid=stop, as the stream holds its dead letter: no false stop,
// nothing stored twice, and the rows after it go on.
func TestDeadLetteredRowReplayedUnderStop(t *testing.T) {
	f := newFixture(t, withDDL(permissiveOutbox))
	p := f.start("JETBOX_ON_INVALID=dead-letter")
	f.waitStreaming(p)
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
	f.waitSlotReleased()
	f.pg.Exec(t, "SELECT pg_copy_logical_replication_slot('jetbox', 'jetbox_before')")
	good := func(id string) string {
		return fmt.Sprintf(`INSERT INTO outbox VALUES ('%s', 'order', 'o-1', 'Created', '{"ok": true}', NULL)`, id)
	}
	f.pg.Exec(t, good("good-1")+`; INSERT INTO outbox VALUES ('r-space', 'big order', '1', 'E', '{}', NULL); `+good("good-2"))
	p = f.start("JETBOX_ON_INVALID=dead-letter")
	f.waitCount(3, time.Minute)
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
	f.waitSlotReleased()
	// As if the run had been killed before it confirmed the rows.
	f.pg.Exec(t, "SELECT pg_drop_replication_slot('jetbox')")
	f.pg.Exec(t, "SELECT pg_copy_logical_replication_slot('jetbox_before', 'jetbox')")
	f.pg.Exec(t, "SELECT pg_drop_replication_slot('jetbox_before')")

	p = f.start() // --on-invalid=stop
	if os.Getenv("JETBOX_TEST_DELIVERY") == "dedup" {
		// Dedup mode cannot prove the stream holds the row by its position:
		// it stops, and the way out is one run with dead letters on.
		if code := p.wait(time.Minute); code != exitFailure || !strings.Contains(p.logText(), "r-space") {
			t.Fatalf("dedup mode: exit %d, want 1 naming r-space: %s", code, p.tail(2048))
		}
		p = f.start("JETBOX_ON_INVALID=dead-letter")
	}
	f.waitStreaming(p)
	f.pg.Exec(t, good("good-3"))
	f.waitCount(4, time.Minute)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	var ids []string
	for _, m := range msgs {
		ids = append(ids, m.ID)
	}
	if len(ids) != 4 || ids[0] != "good-1" || !strings.HasPrefix(ids[1], "jetbox-dlq-") || ids[2] != "good-2" || ids[3] != "good-3" ||
		msgs[1].Header.Get(format.HeaderRowID) != "r-space" {
		t.Fatalf("stream holds %v, want good-1, the dead letter of r-space, good-2, good-3", ids)
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d under --on-invalid=stop, want a clean stop: %s", code, p.tail(2048))
	}
	if st := stoppedLine(t, p.logText()); st["duplicates"].(float64) < 2 {
		t.Fatalf("the restart skipped %v replayed events, want 2 or more (the test did not test the replay)", st["duplicates"])
	}
	if os.Getenv("JETBOX_TEST_DELIVERY") != "dedup" && !strings.Contains(p.logText(), "which the stream already holds") {
		t.Fatalf("no log line for the skipped dead-lettered row:\n%s", p.tail(4096))
	}
}

// TestRowNearMaxPayloadIsStored: a row whose message fits max_payload with
// a few hundred bytes to spare is published, not refused as too-large
// (the size check counts the headers as they are sent, Jetbox-Source
// included, instead of a fixed allowance).
func TestRowNearMaxPayloadIsStored(t *testing.T) {
	const maxPayload = 16 * 1024
	f := newFixture(t, withDDL(permissiveOutbox), withNATS(testenv.WithMaxPayload(maxPayload)))
	p := f.start()
	f.waitStreaming(p)
	pad := maxPayload - 450 - len(`{"pad": ""}`)
	f.pg.Exec(t, fmt.Sprintf(`INSERT INTO outbox VALUES ('near-limit', 'order', 'o-1', 'Created', jsonb_build_object('pad', repeat('x', %d)), NULL)`, pad))
	f.pg.Exec(t, `INSERT INTO outbox VALUES ('after', 'order', 'o-1', 'Created', '{}', NULL)`)
	f.waitCount(2, time.Minute)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	if msgs[0].ID != "near-limit" || msgs[1].ID != "after" {
		t.Fatalf("stream holds %s, %s; want near-limit, after", msgs[0].ID, msgs[1].ID)
	}
	m := &nats.Msg{Header: msgs[0].Header, Data: msgs[0].Data}
	if size := m.Size(); size > maxPayload || size < maxPayload-600 {
		t.Fatalf("the message is %d bytes: the test wants one within 600 bytes under max_payload %d", size, maxPayload)
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d: %s", code, p.tail(2048))
	}
}
