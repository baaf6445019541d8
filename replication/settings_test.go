package replication

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
)

const partitioned = "{prefix}.{aggregate_type}.{partition}.{event_type}"

// routed returns a decoder config routing under template with n partitions
// ("" : the default template).
func routed(t *testing.T, template string, n int) decoder.Config {
	t.Helper()
	cfg := decoder.Config{SubjectPrefix: "outbox"}
	if template != "" {
		tpl, err := decoder.ParseTemplate(template, n)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Subjects = tpl
	}
	return cfg
}

// routedTip is the stream's last message, event order/o-1/E, stored under cfg.
func routedTip(t *testing.T, cfg decoder.Config) StreamTip {
	t.Helper()
	subject, err := cfg.SubjectFor("order", "o-1", "E")
	if err != nil {
		t.Fatal(err)
	}
	return StreamTip{Seq: 9, Origin: "42/1/app/jetbox", CommitLSN: 0x3000000, CommitTime: "2026-12-01T20:00:00.000000000Z",
		Routing: cfg.RoutingHeader(), AggregateType: "order", AggregateID: "o-1", EventType: "E", Subject: subject}
}

func TestCheckRouting(t *testing.T) {
	def, p4, p8 := routed(t, "", 0), routed(t, partitioned, 4), routed(t, partitioned, 8)
	byID := routed(t, "{prefix}.{aggregate_type}.{aggregate_id}.{event_type}", 0)
	legacy := func(cfg decoder.Config) StreamTip { // stored by a jetbox that wrote no Jetbox-Routing
		tip := routedTip(t, cfg)
		tip.Routing = ""
		return tip
	}
	// An id whose partition is the same modulo 4 and 8, one whose is not.
	same, moved := "", ""
	for i := 0; i < 100 && (same == "" || moved == ""); i++ {
		id := "o-" + strconv.Itoa(i)
		if decoder.Partition(id, 4) == decoder.Partition(id, 8) {
			same = id
		} else {
			moved = id
		}
	}
	legacyID := func(id string) StreamTip {
		tip := legacy(p4)
		tip.AggregateID = id
		tip.Subject, _ = p4.SubjectFor("order", id, "E")
		return tip
	}
	atomicTip := routedTip(t, p4)
	atomicTip.Routing += " atomic"
	dlq := StreamTip{Seq: 9, Origin: "42/1/app/jetbox", Subject: "outbox._dlq.bad-headers", RowID: "r1"}
	for _, c := range []struct {
		name   string
		tip    StreamTip
		cur    decoder.Config
		refuse string // "": goes on; else the flags named
	}{
		{"default both times", routedTip(t, def), def, ""},
		{"same partitions", routedTip(t, p4), p4, ""},
		{"same partitions, atomic tip", atomicTip, p4, ""},
		{"partitions 4 to 8", routedTip(t, p4), p8, "--partitions=4"},
		{"partitions 8 to 4", routedTip(t, p8), p4, "--partitions=8"},
		{"default to partitioned", routedTip(t, def), p4, "--subject-template={prefix}.{aggregate_type}.{event_type} --partitions=0"},
		{"partitioned to default", routedTip(t, p4), def, "--subject-template=" + partitioned + " --partitions=4"},
		{"template changed", routedTip(t, byID), def, "--subject-template={prefix}.{aggregate_type}.{aggregate_id}.{event_type}"},
		{"a dead letter under the default routing", dlq, def, ""},
		// Without the header a dead letter does not tell the default routing
		// from that of a jetbox that did not record it: nothing to judge.
		{"a dead letter without the header, then partitioned", dlq, p4, ""},
		{"no header, default subject, then default", legacy(def), def, ""},
		{"no header, partitioned subject, same routing (an upgrade)", legacy(p4), p4, ""},
		{"no header, partitioned subject, default run", legacy(p4), def, "another routing"},
		{"no header, partitions 4 to 8, subject moves", legacyID(moved), p8, "another routing"},
		{"no header, partitions 4 to 8, subject stays", legacyID(same), p8, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			changed, err := checkRouting(c.tip, c.cur, false)
			switch {
			case c.refuse == "" && (err != nil || changed):
				t.Fatalf("unexpected refusal (changed %v): %v", changed, err)
			case c.refuse == "":
				return
			case err == nil || !changed:
				t.Fatalf("a change of routing went through (changed %v)", changed)
			case !IsPermanent(err):
				t.Fatalf("not permanent: %v", err)
			}
			var se *SettingsError
			if !errors.As(err, &se) || se.Setting != SettingRouting {
				t.Fatalf("not a routing SettingsError: %v", err)
			}
			msg := err.Error()
			for _, want := range []string{"routed under " + c.refuse, c.tip.Subject, "drain the consumers of the old subjects first", "--allow-routing-change", "JETBOX_ALLOW_ROUTING_CHANGE=true"} {
				if !strings.Contains(msg, want) {
					t.Errorf("error lacks %q: %s", want, msg)
				}
			}
			if changed, err := checkRouting(c.tip, c.cur, true); err != nil || !changed {
				t.Fatalf("--allow-routing-change: changed %v, %v", changed, err)
			}
		})
	}
	// Only the flags that differ are named, as this run gives them.
	_, err := checkRouting(routedTip(t, p4), p8, false)
	if msg := err.Error(); !strings.Contains(msg, "this run routes under --partitions=8:") || strings.Contains(msg, "--subject-template") {
		t.Errorf("partitions 4 to 8: %s", msg)
	}
}

func TestCheckAtomic(t *testing.T) {
	tip := func(routing string, last bool) StreamTip {
		return StreamTip{Seq: 9, Origin: "42/1/app/jetbox", CommitLSN: 0x3000000, CommitTime: "2026-12-01T20:00:00.000000000Z", Routing: routing, TxLast: last}
	}
	const replayed, confirmed = pglogrepl.LSN(0x3000000), pglogrepl.LSN(0x3000100)
	p4 := "template=" + partitioned + " partitions=4"
	for _, c := range []struct {
		name   string
		tip    StreamTip
		atomic bool
		start  pglogrepl.LSN
		refuse string // "": goes on; else the hint's flag
	}{
		{"atomic both times, unfinished", tip("atomic", false), true, replayed, ""},
		{"plain both times, replayed", tip("", false), false, replayed, ""},
		{"atomic to plain, finished", tip("atomic", true), false, replayed, ""},
		{"atomic to plain, unfinished, confirmed", tip("atomic", false), false, confirmed, ""},
		{"atomic to plain, unfinished, replayed", tip("atomic", false), false, replayed, "with --atomic-transactions"},
		{"atomic partitioned to plain, unfinished", tip(p4+" atomic", false), false, replayed, "with --atomic-transactions"},
		{"plain to atomic, replayed", tip("", false), true, replayed, "without --atomic-transactions"},
		{"plain partitioned to atomic, replayed", tip(p4, false), true, replayed, "without --atomic-transactions"},
		{"plain to atomic after a clean stop", tip("", false), true, confirmed, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := checkAtomic(c.tip, c.atomic, c.start)
			switch {
			case c.refuse == "" && err != nil:
				t.Fatalf("unexpected refusal: %v", err)
			case c.refuse == "":
				return
			case err == nil:
				t.Fatal("a switch of --atomic-transactions mid-transaction went through")
			case !IsPermanent(err):
				t.Fatalf("not permanent: %v", err)
			}
			var se *SettingsError
			if !errors.As(err, &se) || se.Setting != SettingAtomic {
				t.Fatalf("not an atomic SettingsError: %v", err)
			}
			msg := err.Error()
			for _, want := range []string{c.tip.CommitLSN.String(), c.tip.CommitTime, "restart once " + c.refuse + " until that transaction is confirmed"} {
				if !strings.Contains(msg, want) {
					t.Errorf("error lacks %q: %s", want, msg)
				}
			}
		})
	}
}
