package replication

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
)

func TestVerifyHistory(t *testing.T) {
	hist := []byte("1\t0/3000100\tno recovery target specified\n\n2\t0/5000000\tno recovery target specified\n")
	srv := func(tl int32, xlog pglogrepl.LSN, slot bool) server {
		return server{sys: pglogrepl.IdentifySystemResult{SystemID: "42", Timeline: tl, XLogPos: xlog, DBName: "app"}, slot: slot,
			history: func(context.Context, int32) ([]byte, error) { return hist, nil }}
	}
	tip := func(src string, lsn pglogrepl.LSN) StreamTip {
		return StreamTip{Seq: 9, Origin: src, CommitLSN: lsn, CommitTime: "2026-12-01T20:00:00.000000000Z"}
	}
	for _, c := range []struct {
		name    string
		tip     StreamTip
		haveTip bool
		srv     server
		want    string // "" or the case
	}{
		{"empty stream, no slot", StreamTip{}, false, srv(1, 0x4000000, false), ""},
		{"other database's stream, no slot", tip("42/1/other/jetbox", 0x3000000), true, srv(1, 0x4000000, false), ""},
		{"other cluster's stream", tip("7/1/app/jetbox", 0x3000000), true, srv(1, 0x4000000, true), ""},
		{"slot lost", tip("42/1/app/jetbox", 0x3000000), true, srv(1, 0x4000000, false), CaseLostSlot},
		{"slot invalidated", tip("42/1/app/jetbox", 0x3000000), true, server{sys: srv(1, 0x4000000, false).sys, lostSlot: true}, CaseLostSlot},
		{"same timeline, behind the server", tip("42/1/app/jetbox", 0x3000000), true, srv(1, 0x4000000, true), ""},
		{"same timeline, ahead of the server", tip("42/1/app/jetbox", 0x5000000), true, srv(1, 0x4000000, true), CaseRewind},
		{"same timeline, at the server", tip("42/1/app/jetbox", 0x4000000), true, srv(1, 0x4000000, true), CaseRewind},
		{"new timeline branched after the tip", tip("42/1/app/jetbox", 0x3000000), true, srv(2, 0x6000000, true), ""},
		{"grandchild timeline", tip("42/1/app/jetbox", 0x3000000), true, srv(3, 0x6000000, true), ""},
		{"new timeline branched at the tip", tip("42/1/app/jetbox", 0x3000100), true, srv(2, 0x6000000, true), CaseTimeline},
		{"new timeline branched before the tip", tip("42/2/app/jetbox", 0x5000100), true, srv(3, 0x6000000, true), CaseTimeline},
		{"server on an older timeline", tip("42/3/app/jetbox", 0x5000100), true, srv(2, 0x6000000, true), CaseTimeline},
		{"timeline not in the history", tip("42/4/app/jetbox", 0x100), true, srv(5, 0x6000000, true), CaseTimeline},
		{"an unfinished repair", tip("42/1/app/jetbox", 0x3000000), true, server{sys: srv(1, 0x4000000, true).sys, slot: true, marker: true}, CaseRepair},
		{"an unfinished repair of an empty stream", StreamTip{}, false, server{sys: srv(1, 0x4000000, true).sys, slot: true, marker: true}, CaseRepair},
		{"a repair killed between its marker and its slot", StreamTip{}, false, server{sys: srv(1, 0x4000000, true).sys, marker: true}, CaseRepair},
		{"a database name with a slash", tip("42/1/a%2Fb/jetbox", 0x5000000), true, server{sys: pglogrepl.IdentifySystemResult{SystemID: "42", Timeline: 1, XLogPos: 0x4000000, DBName: "a/b"}, slot: true}, CaseRewind},
		// A standby reports its replay position, behind the tip for a
		// while after a restart: wait for it, no history break.
		{"a standby replayed short of the tip", tip("42/1/app/jetbox", 0x5000000), true, server{sys: srv(1, 0x4000000, true).sys, slot: true, recovery: true}, "behind"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := verify(context.Background(), c.tip, c.haveTip, c.srv, "jetbox")
			var he *HistoryError
			if c.want == "behind" {
				if !errors.Is(err, errStandbyBehind) || errors.As(err, &he) || IsPermanent(err) {
					t.Fatalf("got %v, want a retryable wait for the standby", err)
				}
				return
			}
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case c.want != "" && !errors.As(err, &he):
				t.Fatalf("got %v, want a %s error", err, c.want)
			case c.want != "" && he.Case != c.want:
				t.Fatalf("case %s, want %s: %v", he.Case, c.want, err)
			case c.want != "" && !IsPermanent(err):
				t.Fatal("not permanent")
			}
		})
	}
}

func TestCheckScheme(t *testing.T) {
	const mixed, messages = "table,messages:jetbox", "messages:jetbox"
	tip := func(scheme string, lsn pglogrepl.LSN) StreamTip {
		return StreamTip{Seq: 9, Origin: "42/1/app/jetbox", CommitLSN: lsn, CommitTime: "2026-12-01T20:00:00.000000000Z", Scheme: scheme}
	}
	for _, c := range []struct {
		name    string
		tip     StreamTip
		current string
		start   pglogrepl.LSN
		refuse  bool
	}{
		{"same scheme, replayed", tip(mixed, 0x3000000), mixed, 0x3000000, false},
		{"table both times, replayed", tip("", 0x3000000), "", 0x2000000, false},
		{"table to mixed after a clean stop", tip("", 0x3000000), mixed, 0x3000100, false},
		{"mixed to table after a clean stop", tip(mixed, 0x3000000), "", 0x3000100, false},
		{"mixed to table, replayed", tip(mixed, 0x3000000), "", 0x3000000, true},
		{"table to mixed, replayed", tip("", 0x3000000), mixed, 0x2000000, true},
		{"mixed to messages, replayed", tip(mixed, 0x3000000), messages, 0x3000000, true},
		{"other prefix, replayed", tip(mixed, 0x3000000), "table,messages:other", 0x3000000, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := checkScheme(c.tip, c.current, c.start)
			switch {
			case !c.refuse && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case c.refuse && err == nil:
				t.Fatal("a change of scheme with the tip's transaction replayed went through")
			case c.refuse && !IsPermanent(err):
				t.Fatalf("not permanent: %v", err)
			}
			if !c.refuse {
				return
			}
			msg := err.Error()
			for _, want := range []string{c.tip.CommitLSN.String(), c.tip.CommitTime, "restart once with " + describeScheme(c.tip.Scheme), describeScheme(c.current)} {
				if !strings.Contains(msg, want) {
					t.Errorf("error lacks %q: %s", want, msg)
				}
			}
		})
	}
	if got := describeScheme(mixed); got != "--source=table,messages --message-prefix=jetbox" {
		t.Errorf("describeScheme(%q) = %q", mixed, got)
	}
	if got := describeScheme(""); got != "--source=table" {
		t.Errorf(`describeScheme("") = %q`, got)
	}
}

func TestOwnTip(t *testing.T) {
	sys := pglogrepl.IdentifySystemResult{SystemID: "42", Timeline: 2, DBName: "app"}
	for src, want := range map[string]bool{
		"42/1/app/jetbox": true, "42/2/app/jetbox": true, "42/2/other/jetbox": false,
		"7/2/app/jetbox": false, "42/2/app/slot2": false, "garbage": false,
	} {
		if got := ownTip(StreamTip{Origin: src}, sys, "jetbox"); got != want {
			t.Errorf("ownTip(%q) = %v, want %v", src, got, want)
		}
	}
}

// The history error's way out: jetbox repair, except for an outbox of
// messages only, which no repair can re-read.
func TestHistoryErrorWayOut(t *testing.T) {
	he := &HistoryError{Case: CaseLostSlot, Tip: StreamTip{Seq: 9}, Detail: "gone"}
	if msg := he.Error(); !strings.Contains(msg, "run `jetbox repair`") {
		t.Fatalf("table outbox: %s", msg)
	}
	err := withSource(he, Config{Decoder: decoder.Config{MessagePrefix: "jetbox"}})
	if msg := err.Error(); strings.Contains(msg, "jetbox repair") || !strings.Contains(msg, "emit the events") || !strings.Contains(msg, "--accept-lost-rows") {
		t.Fatalf("messages-only outbox: %s", msg)
	}
}

func TestAcceptLostRowsNeverPastAnUnfinishedRepair(t *testing.T) {
	cfg := Config{AcceptLostRows: true}
	if acceptable(&HistoryError{Case: CaseRepair}, cfg) {
		t.Fatal("--accept-lost-rows goes on past an unfinished repair")
	}
	for _, c := range []string{CaseLostSlot, CaseRewind, CaseTimeline} {
		if !acceptable(&HistoryError{Case: c}, cfg) || acceptable(&HistoryError{Case: c}, Config{}) {
			t.Fatalf("%s: accepted only with --accept-lost-rows", c)
		}
	}
}

// TestLostCause: why a lost slot is lost (jetbox_repairs_total's cause),
// and whether a promotion's timeline left the stream's before its tip (the
// stream may then hold rows the promoted server never got).
func TestLostCause(t *testing.T) {
	hist := []byte("1\t0/3000100\tno recovery target specified\n")
	sys := func(tl int32) pglogrepl.IdentifySystemResult {
		return pglogrepl.IdentifySystemResult{SystemID: "42", Timeline: tl, XLogPos: 0x6000000, DBName: "app"}
	}
	withHistory := func(s server) server {
		s.history = func(context.Context, int32) ([]byte, error) { return hist, nil }
		return s
	}
	for _, c := range []struct {
		name     string
		tipLSN   pglogrepl.LSN
		srv      server
		cause    string
		branched bool
	}{
		{"dropped on the stream's timeline", 0x3000000, server{sys: sys(1)}, LostDropped, false},
		{"invalidated", 0x3000000, server{sys: sys(1), lostSlot: true, lostCause: "wal_removed"}, LostInvalidated, false},
		{"promoted after the tip", 0x3000000, withHistory(server{sys: sys(2)}), LostPromotion, false},
		{"promoted at the tip", 0x3000100, withHistory(server{sys: sys(2)}), LostPromotion, true},
		{"promoted before the tip", 0x3000200, withHistory(server{sys: sys(2)}), LostPromotion, true},
		{"promoted, no history to read", 0x3000200, server{sys: sys(2)}, LostPromotion, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			tip := StreamTip{Seq: 9, Origin: "42/1/app/jetbox", CommitLSN: c.tipLSN}
			var he *HistoryError
			if err := verify(context.Background(), tip, true, c.srv, "jetbox"); !errors.As(err, &he) || he.Case != CaseLostSlot {
				t.Fatalf("got %v, want a lost slot", err)
			}
			if he.LostCause != c.cause || he.Branched != c.branched {
				t.Fatalf("cause %q branched %v, want %q %v", he.LostCause, he.Branched, c.cause, c.branched)
			}
			if c.branched != strings.Contains(he.Error(), "may hold rows this server never got") {
				t.Fatalf("error %q", he.Error())
			}
		})
	}
}
