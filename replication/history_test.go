package replication

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pglogrepl"
)

func TestVerifyHistory(t *testing.T) {
	hist := []byte("1\t0/3000100\tno recovery target specified\n\n2\t0/5000000\tno recovery target specified\n")
	srv := func(tl int32, xlog pglogrepl.LSN, slot bool) server {
		return server{sys: pglogrepl.IdentifySystemResult{SystemID: "42", Timeline: tl, XLogPos: xlog, DBName: "app"}, slot: slot,
			history: func(context.Context, int32) ([]byte, error) { return hist, nil }}
	}
	tip := func(src string, lsn pglogrepl.LSN) StreamTip {
		return StreamTip{Seq: 9, Source: src, CommitLSN: lsn, CommitTime: "2026-12-01T20:00:00.000000000Z"}
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
	} {
		t.Run(c.name, func(t *testing.T) {
			err := verify(context.Background(), c.tip, c.haveTip, c.srv, "jetbox")
			var he *HistoryError
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
