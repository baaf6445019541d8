package sink

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go/jetstream"
)

// Tip is the last message jetbox stored on its subjects: where the stream's
// history of a database ends.
type Tip struct {
	Seq        uint64
	Source     string // Jetbox-Source
	CommitLSN  pglogrepl.LSN
	TxIndex    int    // Jetbox-Tx-Index
	ID         string // Nats-Msg-Id
	CommitTime string // Jetbox-Commit-Time, as stored
	Scheme     string // Jetbox-Index-Scheme: "" when absent (--source=table)
}

// Tip returns the last message on <prefix>.> that jetbox wrote (it carries
// Jetbox-Source and Jetbox-Commit-LSN); ok is false when the stream does not
// exist, holds nothing on those subjects, or its last one there is not
// jetbox's. In a stream shared with other writers (dedup mode) the stream's
// last message may be foreign: the last one on jetbox's subjects is asked
// for by subject.
func (p *Publisher) Tip(ctx context.Context) (Tip, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := p.js.Stream(ctx, p.cfg.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return Tip{}, false, nil
	}
	if err != nil {
		return Tip{}, false, fmt.Errorf("look up stream %q: %w", p.cfg.Stream, err)
	}
	m, err := st.GetLastMsgForSubject(ctx, p.cfg.SubjectPrefix+".>")
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return Tip{}, false, nil
	}
	if err != nil {
		return Tip{}, false, fmt.Errorf("read the last message on %s.> of stream %q: %w", p.cfg.SubjectPrefix, p.cfg.Stream, err)
	}
	pos, ok := ParsePosition(m.Header)
	src := m.Header.Get(HeaderSource)
	if !ok || src == "" {
		return Tip{}, false, nil
	}
	return Tip{Seq: m.Sequence, Source: src, CommitLSN: pglogrepl.LSN(pos.CommitLSN), TxIndex: pos.TxIndex, ID: m.Header.Get(jetstream.MsgIDHeader),
		CommitTime: m.Header.Get(HeaderCommitTime),
		Scheme: m.Header.Get(HeaderIndexScheme)}, true, nil
}

// ForgetPositionsThrough tells later sessions that the stream's messages up
// to seq come from a WAL history the server no longer continues (an
// operator accepted lost rows after a rewind or a failover): exactly-once
// mode then skips no event by position against them.
func (p *Publisher) ForgetPositionsThrough(seq uint64) { p.forgetThrough.Store(seq) }

// sameWriter reports whether two Jetbox-Source values name the same system,
// database and slot, whatever their timelines: replication checks, before
// a session opens, that the server's timeline continues the stream's.
// writerOf is source without its timeline: the system, database and slot
// (a failover keeps the writer; replication checks the timeline continues
// the stream's). A source of another shape is its own writer.
func writerOf(source string) string {
	f := strings.Split(source, "/")
	if len(f) != 4 {
		return source
	}
	if _, err := strconv.ParseUint(f[1], 10, 32); err != nil {
		return source
	}
	return f[0] + "/" + f[2] + "/" + f[3]
}

func sameWriter(a, b string) bool {
	as, bs := strings.Split(a, "/"), strings.Split(b, "/")
	if len(as) != 4 || len(bs) != 4 {
		return a == b
	}
	if _, err := strconv.ParseUint(as[1], 10, 32); err != nil {
		return a == b
	}
	if _, err := strconv.ParseUint(bs[1], 10, 32); err != nil {
		return a == b
	}
	return as[0] == bs[0] && as[2] == bs[2] && as[3] == bs[3]
}
