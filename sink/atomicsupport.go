package sink

// What the server and the stream support of atomic batches: the checks
// OpenAtomic, EnsureStream and Check share, and the server's batch limit.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// DefaultAtomicBatch is JetStream's default limit on the messages of one
// atomic batch (server setting jetstream { limits { batch { max_msgs } } }).
const DefaultAtomicBatch = 1000

// The first nats-server release with atomic batch publishing.
const atomicMajor, atomicMinor = 2, 12

// atomicSupport says why the server or the stream cannot take atomic
// batches (a permanent error with its fix), or returns nil.
func (p *Publisher) atomicSupport(streamAllows bool) error {
	v := p.nc.ConnectedServerVersion()
	if v == "" {
		return errors.New("--atomic-transactions: not connected to NATS: cannot tell whether the server has atomic batches")
	}
	if !versionAtLeast(v, atomicMajor, atomicMinor) {
		return &PermanentError{Err: fmt.Errorf("--atomic-transactions: NATS server %s has no atomic batch publishing (nats-server %d.%d or later)", v, atomicMajor, atomicMinor),
			Hint: "upgrade the NATS servers, or run without --atomic-transactions"}
	}
	if !streamAllows {
		return &PermanentError{Err: fmt.Errorf("--atomic-transactions: stream %q does not allow atomic publish", p.cfg.Stream),
			Hint: fmt.Sprintf("allow it (stream setting allow_atomic: true, e.g. with nats stream edit %s --interactive), or run without --atomic-transactions", p.cfg.Stream)}
	}
	return nil
}

// versionAtLeast reports whether a server version such as "2.12.1" is at
// least major.minor.
func versionAtLeast(v string, major, minor int) bool {
	parts := strings.SplitN(strings.TrimPrefix(v, "v"), ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, err1 := strconv.Atoi(parts[0])
	mi, err2 := strconv.Atoi(strings.SplitN(parts[1], "-", 2)[0])
	return err1 == nil && err2 == nil && (ma > major || (ma == major && mi >= minor))
}

// AtomicBatchLimit returns how many messages an atomic batch may hold:
// DefaultAtomicBatch, the window (Config.MaxPending) or the server's limit,
// whichever is smallest. It asks the server about batches that were never
// started, which store nothing.
func (p *Publisher) AtomicBatchLimit(ctx context.Context) (int, error) {
	want := min(DefaultAtomicBatch, p.cfg.MaxPending)
	if want <= 1 {
		return 1, nil // a probe of 1 would open a batch
	}
	fits := func(n int) (bool, error) {
		code, err := p.probe(ctx, p.cfg.SubjectPrefix+"."+format.ProbeToken+".probe", "", n, false)
		switch {
		case err != nil:
			return false, fmt.Errorf("ask NATS for its atomic batch limit: %w", err)
		case code == jetstreamext.JSErrCodeBatchPublishIncomplete:
			return true, nil
		case code == jetstreamext.JSErrCodeBatchPublishExceedsLimit:
			return false, nil
		case code == jetstreamext.JSErrCodeBatchPublishNotEnabled:
			return false, p.atomicSupport(false)
		}
		return false, fmt.Errorf("ask NATS for its atomic batch limit: unexpected reply (error code %d)", code)
	}
	ok, err := fits(want)
	if ok || err != nil {
		return want, err
	}
	lo, hi := 1, want // lo fits (1 always does), hi does not
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if ok, err := fits(mid); err != nil {
			return 0, err
		} else if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, nil
}

// probe sends one message of a fresh batch that can never be stored (it
// expects an impossible last sequence, so even a server without batches
// refuses it) and returns the error code of the reply. A message with batch
// sequence n > 1 asks whether a batch may be that long; n = 1 with commit
// and id asks whether the stream's duplicate window holds id (JetStream
// checks it before the expected sequence).
func (p *Publisher) probe(ctx context.Context, subject, id string, n int, commit bool) (jetstream.ErrorCode, error) {
	m := nats.NewMsg(subject)
	var id16 [16]byte
	_, _ = rand.Read(id16[:]) // never fails (crypto/rand)
	m.Header[jetstreamext.BatchIDHeader] = []string{hex.EncodeToString(id16[:])}
	m.Header[jetstreamext.BatchSeqHeader] = []string{strconv.Itoa(n)}
	if commit {
		m.Header[jetstreamext.BatchCommitHeader] = []string{"1"}
	}
	if id != "" {
		m.Header[jetstream.MsgIDHeader] = []string{id}
	}
	m.Header[jetstream.ExpectedStreamHeader] = []string{p.cfg.Stream}
	m.Header[jetstream.ExpectedLastSeqHeader] = []string{"18446744073709551615"}
	resp, err := p.nc.RequestMsgWithContext(ctx, m)
	if err != nil {
		return 0, err
	}
	var reply struct {
		Error *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &reply); err != nil {
		return 0, fmt.Errorf("read the reply %q: %w", resp.Data, err)
	}
	if reply.Error == nil {
		return 0, fmt.Errorf("the server accepted a probe it should refuse: %s", resp.Data)
	}
	return reply.Error.ErrorCode, nil
}
