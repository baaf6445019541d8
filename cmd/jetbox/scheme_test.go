package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestIndexSchemeChange: --source and --message-prefix decide how
// Jetbox-Tx-Index counts a transaction's events. Changed after a clean stop
// they take effect; changed while the slot would replay the transaction of
// the stream's last message, the indexes of its events would shift (a row
// skipped as a replay: lost; or a stored one taken for new), so jetbox
// refuses, confirms nothing, and starts again with the tip's settings.
//
// The replayed tip is made by hand: a copy of the last message whose commit
// LSN is the slot's confirmed position (what a transaction acked in part at
// a stop, or before a crash, leaves).
func TestIndexSchemeChange(t *testing.T) {
	f := newFixture(t)
	if !testMixedSource() { // otherwise the fixture made it
		f.pg.Exec(t, emitFunctionDDL)
	}
	f.env = withoutEnv(f.env, "JETBOX_SOURCE") // each start says its own
	const mixed = "table,messages:jetbox"
	table, both := "JETBOX_SOURCE=table", "JETBOX_SOURCE=table,messages"
	conn := f.conn()
	var want []string
	// rowAndMessage commits an outbox row and then a jetbox_emit message in
	// one transaction and returns their ids.
	rowAndMessage := func(agg string) []string {
		ctx := ctxT(t, time.Minute)
		tx, err := conn.Begin(ctx)
		must(t, err)
		var row, msg string
		must(t, tx.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'E', '{}') RETURNING id::text`, agg).Scan(&row))
		must(t, tx.QueryRow(ctx, `SELECT jetbox_emit('order', $1, 'E', '{}')::text`, agg).Scan(&msg))
		must(t, tx.Commit(ctx))
		return []string{row, msg}
	}
	stop := func(p *proc) {
		t.Helper()
		if code := p.stop(); code != exitOK {
			t.Fatalf("exit %d:\n%s", code, p.tail(4096))
		}
	}
	// inject stores a copy of the stream's last message at the slot's
	// confirmed position, index 0, counted under scheme.
	inject := func(scheme string) string {
		t.Helper()
		lsn, _, err := f.slotState()
		must(t, err)
		msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
		last := msgs[len(msgs)-1]
		h := nats.Header{}
		for k, v := range last.Header {
			if strings.HasPrefix(k, "Jetbox-") {
				h[k] = v
			}
		}
		delete(h, "Jetbox-Index-Scheme")
		if scheme != "" {
			h["Jetbox-Index-Scheme"] = []string{scheme}
		}
		id := fmt.Sprintf("injected-%s", lsn)
		h["Jetbox-Commit-LSN"], h["Jetbox-Tx-Index"], h[jetstream.MsgIDHeader] = []string{lsn.String()}, []string{"0"}, []string{id}
		_, err = f.js.PublishMsg(ctxT(t, 10*time.Second), &nats.Msg{Subject: last.Subject, Header: h, Data: last.Data})
		must(t, err)
		want = append(want, id)
		return lsn.String()
	}
	// refused starts jetbox with env, expects the refusal, and checks it
	// confirmed and stored nothing.
	refused := func(tipLSN, tipFlags, flags string, env ...string) {
		t.Helper()
		before, _, err := f.slotState()
		must(t, err)
		p := f.start(env...)
		p.waitExit(exitFailure, "the stream's last transaction (commit LSN "+tipLSN, "under "+tipFlags,
			"differently ("+flags+")", "restart once with "+tipFlags+" until that transaction is confirmed")
		after, _, err := f.slotState()
		must(t, err)
		if after != before {
			t.Fatalf("the refused run moved the slot from %s to %s", before, after)
		}
		f.waitCount(len(want), 10*time.Second)
	}

	// Table only: no scheme header, as before there were messages.
	p := f.start(table)
	f.waitStreaming(p)
	want = append(want, f.insertTx(conn, "t1", 1)...)
	f.waitCount(len(want), 30*time.Second)
	stop(p)
	if h := testenv.ReadStream(t, f.js, "OUTBOX", true)[0].Header; h.Get("Jetbox-Index-Scheme") != "" {
		t.Fatalf("--source=table message carries Jetbox-Index-Scheme %q", h.Get("Jetbox-Index-Scheme"))
	}

	// Changed after a clean stop: goes through, rows and messages counted together.
	p = f.start(both)
	f.waitStreaming(p)
	want = append(want, rowAndMessage("m1")...)
	f.waitCount(len(want), 30*time.Second)
	stop(p)
	for i, m := range testenv.ReadStream(t, f.js, "OUTBOX", true)[1:] {
		if m.Header.Get("Jetbox-Index-Scheme") != mixed || m.Header.Get("Jetbox-Tx-Index") != fmt.Sprint(i) {
			t.Fatalf("event %d of the mixed transaction: Jetbox-Index-Scheme %q, Jetbox-Tx-Index %q", i, m.Header.Get("Jetbox-Index-Scheme"), m.Header.Get("Jetbox-Tx-Index"))
		}
	}

	// A replayed table-only tip: table,messages is refused, table goes on.
	tipLSN := inject("")
	later := f.insertTx(conn, "t2", 1) // committed meanwhile: must not be lost
	refused(tipLSN, "--source=table", "--source=table,messages --message-prefix=jetbox", both)
	p = f.start(table)
	f.waitStreaming(p)
	want = append(want, later...)
	f.waitCount(len(want), 30*time.Second)
	stop(p)

	// A replayed mixed tip: table is refused, and so is another prefix;
	// table,messages with the tip's prefix goes on.
	tipLSN = inject(mixed)
	later = rowAndMessage("m2")
	refused(tipLSN, "--source=table,messages --message-prefix=jetbox", "--source=table", table)
	refused(tipLSN, "--source=table,messages --message-prefix=jetbox", "--source=table,messages --message-prefix=acme", both, "JETBOX_MESSAGE_PREFIX=acme")
	p = f.start(both)
	f.waitStreaming(p)
	want = append(want, later...)
	f.waitCount(len(want), 30*time.Second)
	stop(p)
	f.assertStream(want)
}
