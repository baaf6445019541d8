package replication

import (
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
)

func TestMembershipContinuous(t *testing.T) {
	rel := func(oid uint32) memberRow { return memberRow{Kind: "table", OID: oid} }
	for _, tc := range []struct {
		name      string
		then, now []memberRow
		want      bool
	}{
		{"same row", []memberRow{rel(10)}, []memberRow{rel(10)}, true},
		{"re-created", []memberRow{rel(10)}, []memberRow{rel(11)}, false},
		{"one of two kept", []memberRow{rel(10), {Kind: "schema", OID: 20}}, []memberRow{{Kind: "schema", OID: 20}}, true},
		{"another route", []memberRow{rel(10)}, []memberRow{{Kind: "schema", OID: 10}}, false},
		{"nothing tracked", nil, nil, false},
	} {
		if got := continuous(membership{Rows: tc.then, PubXmin: "7"}, membership{Rows: tc.now, PubXmin: "7"}); got != tc.want {
			t.Errorf("%s: continuous = %v, want %v", tc.name, got, tc.want)
		}
	}
	// The same rows, the publication row rewritten (publish set off and on).
	if continuous(membership{Rows: []memberRow{rel(10)}, PubXmin: "7"}, membership{Rows: []memberRow{rel(10)}, PubXmin: "9"}) {
		t.Error("publication altered: continuous")
	}
}

func TestMembershipPredatesSlot(t *testing.T) {
	old, newer := memberRow{Kind: "table", OID: 1}, memberRow{Kind: "table", OID: 2, Newer: true}
	for _, tc := range []struct {
		name string
		m    membership
		want bool
	}{
		{"no slot", membership{Rows: []memberRow{newer}}, true},
		{"not tracked", membership{SlotKnown: true}, true},
		{"older than catalog_xmin", membership{SlotKnown: true, Rows: []memberRow{old}}, true},
		{"newer", membership{SlotKnown: true, Rows: []memberRow{newer}}, false},
		{"one route older", membership{SlotKnown: true, Rows: []memberRow{newer, {Kind: "schema", OID: 3}}}, true},
		{"publication altered", membership{SlotKnown: true, PubNewer: true, Rows: []memberRow{old}}, false},
	} {
		if got := tc.m.predatesSlot(); got != tc.want {
			t.Errorf("%s: predatesSlot = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestMembershipProblems(t *testing.T) {
	cfg := Config{Slot: "jetbox", Publication: "jetbox", Decoder: decoder.Config{Schema: "public", Table: "outbox", Columns: decoder.DefaultColumns}}
	if ps := (membership{}).problems(cfg); len(ps) != 0 {
		t.Fatalf("no filter, no column list: %v", ps)
	}
	ps := membership{RowFilter: "(event_type <> 'x'::text)", Left: []string{"headers"}}.problems(cfg)
	if len(ps) != 2 {
		t.Fatalf("got %d problems, want 2: %v", len(ps), ps)
	}
	for i, want := range [][]string{
		{`publication "jetbox" publishes public.outbox with a row filter (WHERE (event_type <> 'x'::text))`, "never streams"},
		{`leaves out column "headers"`, "traceparent included"},
	} {
		for _, w := range want {
			if !strings.Contains(ps[i].What, w) {
				t.Errorf("problem %d lacks %q: %s", i, w, ps[i].What)
			}
		}
		if !strings.Contains(ps[i].Fix, `BEGIN; ALTER PUBLICATION "jetbox" DROP TABLE "public"."outbox"; ALTER PUBLICATION "jetbox" ADD TABLE "public"."outbox"; COMMIT`) {
			t.Errorf("problem %d: fix %q", i, ps[i].Fix)
		}
	}
	// Another column left out: no word about headers.
	ps = membership{Left: []string{"aggregate_id"}}.problems(cfg)
	if len(ps) != 1 || strings.Contains(ps[0].What, "traceparent") {
		t.Fatalf("aggregate_id left out: %v", ps)
	}
}

func TestRepairFix(t *testing.T) {
	got := repairFix(Config{Slot: "it's"}, "2026-12-02T10:00:00Z")
	for _, w := range []string{`pg_drop_replication_slot('it''s')`, "`jetbox repair --since 2026-12-02T10:00:00Z`", "then start jetbox"} {
		if !strings.Contains(got, w) {
			t.Errorf("fix lacks %q: %s", w, got)
		}
	}
}

func TestMembershipSettle(t *testing.T) {
	m := membership{SlotKnown: true, PubXmin: "5", PubNewer: true, Rows: []memberRow{{Kind: "table", OID: 1, Xmin: "9", Newer: true}}}
	if got := m.suspects(); len(got) != 2 || got[0] != "5" || got[1] != "9" {
		t.Fatalf("suspects = %v", got)
	}
	if m.settle(map[string]bool{}).predatesSlot() {
		t.Error("neither placed before the slot's position: settled as older")
	}
	if !m.settle(map[string]bool{"5": true, "9": true}).predatesSlot() {
		t.Error("both placed before the slot's position: not settled as older")
	}
	if m.settle(map[string]bool{"5": true}).predatesSlot() {
		t.Error("the table's row not placed before the slot's position: settled as older")
	}
	if m.settle(map[string]bool{"9": true}).predatesSlot() {
		t.Error("the publication's row not placed before the slot's position: settled as older")
	}
	if !m.Rows[0].Newer {
		t.Error("settle changed its receiver's rows")
	}
}

// The membership is read before every START_REPLICATION: a session after
// it was re-created (here between a standby's attempts) stops Run with a
// permanent error naming the catalog rows and the repair; a row filter
// stops the first session.
func TestMembershipCheckedEverySession(t *testing.T) {
	h := newHarness(t, Config{}, &fakeSink{})
	h.wal.setSlotBusy(true)
	h.run()
	waitFor(t, "standby and 2 attempts", func() bool {
		_, starts, _ := h.wal.counts()
		return h.s.State() == StateStandby && starts >= 2
	})
	h.wal.setMembership(16500, "")
	var err error
	select {
	case err = <-h.done:
		h.done = nil
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not stop on the re-created membership")
	}
	if !IsPermanent(err) {
		t.Fatalf("Run returned %v, want a permanent error", err)
	}
	for _, w := range []string{"re-created while jetbox was reconnecting", "table:16400", "table:16500", "jetbox repair"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error lacks %q: %v", w, err)
		}
	}

	h = newHarness(t, Config{}, &fakeSink{})
	h.wal.setMembership(0, "(event_type <> 'x'::text)")
	h.run()
	select {
	case err = <-h.done:
		h.done = nil
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not stop on the row filter")
	}
	if !IsPermanent(err) || !strings.Contains(err.Error(), "with a row filter (WHERE (event_type <> 'x'::text))") {
		t.Fatalf("Run returned %v, want the row filter", err)
	}
	if _, starts, _ := h.wal.counts(); starts != 0 {
		t.Fatalf("%d START_REPLICATION under a row filter", starts)
	}
}
