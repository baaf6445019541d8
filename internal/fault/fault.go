// Package fault holds the one shape of an error jetbox stops on rather than
// retries: what went wrong, and a hint saying what to do about it.
package fault

import "errors"

// Permanent is an error retrying cannot fix; jetbox stops on it. Hint says
// what the operator (or the producer) should do; it may be empty.
type Permanent struct {
	Err  error
	Hint string
}

// New returns a permanent error with a hint.
func New(err error, hint string) *Permanent { return &Permanent{Err: err, Hint: hint} }

func (e *Permanent) Error() string {
	if e.Hint == "" {
		return e.Err.Error()
	}
	return e.Err.Error() + ": " + e.Hint
}

func (e *Permanent) Unwrap() error { return e.Err }

// Permanent marks the error as one to stop on.
func (e *Permanent) Permanent() bool { return true }

// Marker is implemented by the error types that mark themselves as ones to
// stop on: Permanent and replication.HistoryError (a broken WAL history).
// Not every error jetbox stops on implements it: decoder.InvalidEventError
// (an invalid row), decoder.ErrProtocol, decoder.ErrTableReplaced and some
// Postgres errors are told apart by replication.IsPermanent.
type Marker interface{ Permanent() bool }

// Is reports whether err, or an error it wraps, is marked permanent.
func Is(err error) bool {
	var m Marker
	return errors.As(err, &m) && m.Permanent()
}
