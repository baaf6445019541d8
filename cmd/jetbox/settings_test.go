package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestRoutingChange: the stream's messages record their routing
// (Jetbox-Routing). A restart with another --partitions would move
// aggregates to other partition subjects while consumers read the old
// ones, so jetbox refuses (exit 2) naming the flags and the way out,
// confirms and stores nothing; with --allow-routing-change it goes on
// under the new routing, and once a message of it is stored the check is
// moot: a restart without the override goes on too. Nothing committed
// meanwhile is lost or stored twice.
func TestRoutingChange(t *testing.T) {
	f := newFixture(t)
	const template = "{prefix}.{aggregate_type}.{partition}.{event_type}"
	f.env = append(withoutEnv(f.env, "JETBOX_PARTITIONS"), "JETBOX_SUBJECT_TEMPLATE="+template)
	p4, p8, allow := "JETBOX_PARTITIONS=4", "JETBOX_PARTITIONS=8", "JETBOX_ALLOW_ROUTING_CHANGE=true"
	// An aggregate whose partition differs modulo 4 and 8: its subject moves.
	agg := ""
	for i := 0; agg == ""; i++ {
		if id := fmt.Sprintf("order-%d", i); decoder.Partition(id, 4) != decoder.Partition(id, 8) {
			agg = id
		}
	}
	conn := f.conn()
	stop := func(p *proc) {
		t.Helper()
		if code := p.stop(); code != exitOK {
			t.Fatalf("exit %d:\n%s", code, p.tail(4096))
		}
	}
	// check asserts the stream's messages from index from on are on agg's
	// subject under n partitions and carry routing in Jetbox-Routing.
	check := func(from, n int, routing string) {
		t.Helper()
		msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)[from:]
		want := fmt.Sprintf("outbox.order.%d.OrderCreated", decoder.Partition(agg, n))
		for _, m := range msgs {
			if m.Subject != want || m.Header.Get("Jetbox-Routing") != routing {
				t.Fatalf("seq %d: subject %s, Jetbox-Routing %q; want %s, %q", m.Seq, m.Subject, m.Header.Get("Jetbox-Routing"), want, routing)
			}
		}
	}

	p := f.start(p4)
	f.waitStreaming(p)
	want := f.insertTx(conn, agg, 3)
	f.waitCount(len(want), 30*time.Second)
	stop(p)
	check(0, 4, "template="+template+" partitions=4")

	// Another partition count: refused, nothing confirmed or stored.
	later := f.insertTx(conn, agg, 2) // committed meanwhile: must not be lost
	before, _, err := f.slotState()
	must(t, err)
	p = f.start(p8)
	p.waitExit(exitConfig, "was routed under --partitions=4, and this run routes under --partitions=8",
		"restart with --partitions=4 (the stream's routing)", "drain the consumers of the old subjects first",
		"restart once with --allow-routing-change (JETBOX_ALLOW_ROUTING_CHANGE=true)", "the check is moot once one message under the new routing is stored")
	after, _, err := f.slotState()
	must(t, err)
	if after != before {
		t.Fatalf("the refused run moved the slot from %s to %s", before, after)
	}
	f.waitCount(len(want), 10*time.Second)

	// The deliberate change goes on under the new routing.
	p = f.start(p8, allow)
	f.waitStreaming(p)
	n := len(want)
	want = append(want, later...)
	f.waitCount(len(want), 30*time.Second)
	stop(p)
	if !strings.Contains(p.logText(), "--allow-routing-change: going on") {
		t.Fatalf("no warning of the routing change:\n%s", p.tail(4096))
	}
	check(n, 8, "template="+template+" partitions=8")

	// A message of the new routing is stored: the override is not needed.
	p = f.start(p8)
	f.waitStreaming(p)
	n = len(want)
	want = append(want, f.insertTx(conn, agg, 1)...)
	f.waitCount(len(want), 30*time.Second)
	stop(p)
	check(n, 8, "template="+template+" partitions=8")
	f.assertStream(want)
}

// TestAtomicSwitchMidTransaction: a restart that switches
// --atomic-transactions while the slot replays the transaction of the
// stream's last message, unfinished there, is refused (exit 2) with the
// way out: restart once in the tip's mode; that run goes on. Both ways:
// an atomic-mode tip without Jetbox-Tx-Last (a chunked transaction stored
// in part) and a tip stored without atomic batches.
//
// The replayed tip is made by hand, as in TestIndexSchemeChange: a copy of
// the last message whose commit LSN is the slot's confirmed position.
func TestAtomicSwitchMidTransaction(t *testing.T) {
	f := newFixture(t)
	f.env = append(withoutEnv(f.env, "JETBOX_DELIVERY"), exactlyOnce)
	plain := "JETBOX_ATOMIC_TRANSACTIONS=false"
	conn := f.conn()
	var want []string
	stop := func(p *proc) {
		t.Helper()
		if code := p.stop(); code != exitOK {
			t.Fatalf("exit %d:\n%s", code, p.tail(4096))
		}
	}
	// inject stores a copy of the stream's last message at the slot's
	// confirmed position with Jetbox-Routing routing and no Jetbox-Tx-Last.
	inject := func(routing string) {
		t.Helper()
		lsn, _, err := f.slotState()
		must(t, err)
		msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
		last := msgs[len(msgs)-1]
		h := nats.Header{}
		for k, v := range last.Header {
			if strings.HasPrefix(k, "Jetbox-") && k != "Jetbox-Tx-Last" && k != "Jetbox-Routing" {
				h[k] = v
			}
		}
		if routing != "" {
			h["Jetbox-Routing"] = []string{routing}
		}
		id := fmt.Sprintf("injected-%s", lsn)
		h["Jetbox-Commit-LSN"], h["Jetbox-Tx-Index"], h[jetstream.MsgIDHeader] = []string{lsn.String()}, []string{"0"}, []string{id}
		_, err = f.js.PublishMsg(ctxT(t, 10*time.Second), &nats.Msg{Subject: last.Subject, Header: h, Data: last.Data})
		must(t, err)
		want = append(want, id)
	}
	refused := func(hint, env string) {
		t.Helper()
		before, _, err := f.slotState()
		must(t, err)
		p := f.start(env)
		p.waitExit(exitConfig, "and the slot replays it", "restart once "+hint+" until that transaction is confirmed")
		after, _, err := f.slotState()
		must(t, err)
		if after != before {
			t.Fatalf("the refused run moved the slot from %s to %s", before, after)
		}
		f.waitCount(len(want), 10*time.Second)
	}
	goesOn := func(env string, later []string) {
		t.Helper()
		p := f.start(env)
		f.waitStreaming(p)
		want = append(want, later...)
		f.waitCount(len(want), 30*time.Second)
		stop(p)
	}

	p := f.start(atomicTx)
	f.waitStreaming(p)
	want = append(want, f.insertTx(conn, "a1", 3)...)
	f.waitCount(len(want), 30*time.Second)
	stop(p)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	for i, m := range msgs {
		if m.Header.Get("Jetbox-Routing") != "atomic" || (m.Header.Get("Jetbox-Tx-Last") == "true") != (i == len(msgs)-1) {
			t.Fatalf("message %d of an atomic transaction: Jetbox-Routing %q, Jetbox-Tx-Last %q", i, m.Header.Get("Jetbox-Routing"), m.Header.Get("Jetbox-Tx-Last"))
		}
	}

	// An unfinished atomic transaction replayed: the plain run is refused.
	inject("atomic")
	later := f.insertTx(conn, "a2", 2)
	refused("with --atomic-transactions", plain)
	goesOn(atomicTx, later)

	// A plain transaction replayed: the atomic run is refused.
	inject("")
	later = f.insertTx(conn, "a3", 2)
	refused("without --atomic-transactions", atomicTx)
	goesOn(plain, later)
	f.assertStream(want)
}
