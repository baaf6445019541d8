package replication

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
)

// sendStatus confirms the tracker's safe LSN in all three positions.
func (l *loop) sendStatus(replyRequested bool) error {
	safe := l.tracker.Safe()
	if l.replay.holding() {
		safe = l.start // the replay of the stream's tip is not proven yet
	}
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), l.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: safe, WALFlushPosition: safe, WALApplyPosition: safe, ReplyRequested: replyRequested,
	})
	if err != nil {
		return fmt.Errorf("send standby status: %w", err)
	}
	if safe != l.sent {
		l.log.Debug().Str("lsn", safe.String()).Msg("confirmed")
		l.sent = safe
	}
	l.s.sent.Store(uint64(safe))
	l.s.cfg.Metrics.ConfirmedLSN.Set(float64(safe))
	events, _ := l.tracker.InFlight()
	l.s.cfg.Metrics.InFlight.Set(float64(events))
	l.nextStatus = time.Now().Add(l.s.cfg.StatusInterval)
	return nil
}
