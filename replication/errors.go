package replication

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/fault"
)

// PermanentError is an error retrying cannot fix; jetbox stops on it. Hint
// says what to do. It is jetbox's one shape of such an error (see
// internal/fault).
type PermanentError = fault.Permanent

// IsPermanent reports whether err should stop jetbox rather than reconnect.
func IsPermanent(err error) bool {
	var ie *decoder.InvalidEventError
	if fault.Is(err) || errors.As(err, &ie) || errors.Is(err, decoder.ErrProtocol) || errors.Is(err, decoder.ErrTableReplaced) || errors.Is(err, decoder.ErrUnplacedTable) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "42704", // slot or publication does not exist
			"28000", "28P01", // authentication
			"42501", // insufficient privilege
			"3D000": // database does not exist
			return true
		case "55000": // object not in prerequisite state: slot invalidated
			return strings.Contains(pgErr.Message, "can no longer get changes")
		}
	}
	return false
}

func isSlotInUse(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55006"
}

// replacedError explains an outbox table dropped and recreated under jetbox.
func (s *Streamer) replacedError(was, now uint32, when string) error {
	t := s.cfg.qualifiedTable()
	return fmt.Errorf("%w: table %s was dropped and recreated %s (relation OID %d at start, now %d): Postgres streams a new table only from the moment it is added to publication %q, so rows inserted into it before then were never streamed, and jetbox stops rather than lose them silently; "+
		"fix: re-insert, with their ids, the rows of %s committed before it was added to the publication again (the stream dedups those it has), then restart jetbox (should it refuse the table's membership in the publication as newer than the slot's position, those are the rows you re-inserted: start it once with --accept-lost-rows)",
		decoder.ErrTableReplaced, t, when, was, now, s.cfg.Publication, t)
}

var errAbandoned = errors.New("no PubAck before the publish session was abandoned")
