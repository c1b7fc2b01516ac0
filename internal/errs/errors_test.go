package errs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
)

func TestCode(t *testing.T) {
	t.Parallel()
	ctxCanceled := fmt.Errorf("get: %w", context.Canceled)
	tests := []struct {
		name string
		err  error
		want ErrorCode
		is   []error // must match
		not  []error // must not match
	}{
		{"nil", nil, OK, nil, []error{ErrTransient, ErrPermanent, ErrNotFound}},
		{"plain", io.EOF, Unknown, []error{io.EOF}, []error{ErrTransient, ErrPermanent, ErrNotFound}},
		{"transient", WithCode(Transient, io.EOF), Transient, []error{ErrTransient, io.EOF}, []error{ErrPermanent, ErrNotFound}},
		{"permanent", Errorf(Permanent, "bad: %w", io.EOF), Permanent, []error{ErrPermanent, io.EOF}, []error{ErrTransient}},
		{"not found", WithCode(NotFound, errors.New("no domain")), NotFound, []error{ErrNotFound}, []error{ErrTransient, ErrPermanent}},
		{"wrapped by fmt keeps class", fmt.Errorf("op x: %w", WithCode(NotFound, io.EOF)), NotFound, []error{ErrNotFound, io.EOF}, []error{ErrTransient}},
		{"explicit outer class wins", WithCode(Transient, WithCode(Permanent, io.EOF)), Transient, []error{ErrTransient, io.EOF}, []error{ErrPermanent}},
		{"explicit outer wins through fmt", fmt.Errorf("read: %w", WithCode(Transient, fmt.Errorf("addr: %w", WithCode(Permanent, io.EOF)))), Transient, []error{ErrTransient, io.EOF}, []error{ErrPermanent}},
		{"same class rewrap is identity", WithCode(Permanent, WithCode(Permanent, io.EOF)), Permanent, []error{ErrPermanent}, []error{ErrTransient}},
		{"context canceled", ctxCanceled, Canceled, []error{context.Canceled}, []error{ErrTransient, ErrPermanent}},
		{"context deadline", fmt.Errorf("x: %w", context.DeadlineExceeded), DeadlineExceeded, []error{context.DeadlineExceeded}, []error{ErrTransient}},
		{"FromContext canceled", FromContext(context.Canceled), Canceled, []error{context.Canceled}, []error{ErrPermanent}},
		{"FromContext deadline", FromContext(context.DeadlineExceeded), DeadlineExceeded, []error{context.DeadlineExceeded}, nil},
		{"FromContext other unchanged", FromContext(io.EOF), Unknown, []error{io.EOF}, nil},
		{"explicit class wins over context", WithCode(Transient, context.DeadlineExceeded), Transient, []error{ErrTransient, context.DeadlineExceeded}, nil},
		{"spec conflict", Errorf(Permanent, "create x: %w", ErrSpecConflict), Permanent, []error{ErrPermanent, ErrSpecConflict}, []error{ErrTransient, ErrNotFound}},
		{"joined", errors.Join(io.EOF, WithCode(Permanent, io.ErrUnexpectedEOF)), Permanent, []error{ErrPermanent, io.ErrUnexpectedEOF}, nil},
		// The sentinels are classed themselves, bare or wrapped.
		{"bare not found", ErrNotFound, NotFound, []error{ErrNotFound}, []error{ErrTransient, ErrPermanent}},
		{"fmt wraps bare sentinel", fmt.Errorf("x: %w", ErrNotFound), NotFound, []error{ErrNotFound}, []error{ErrTransient, ErrPermanent}},
		{"bare closed is permanent", ErrClosed, Permanent, []error{ErrClosed, ErrPermanent}, []error{ErrTransient, ErrNotFound, ErrSpecConflict}},
		{"bare spec conflict is permanent", fmt.Errorf("x: %w", ErrSpecConflict), Permanent, []error{ErrSpecConflict, ErrPermanent}, []error{ErrClosed, ErrTransient}},
		// WithCode hides bare sentinels too, not only *Error.
		{"WithCode hides bare sentinel", WithCode(Transient, fmt.Errorf("x: %w", ErrNotFound)), Transient, []error{ErrTransient}, []error{ErrPermanent, ErrNotFound}},
		{"WithCode hides ErrClosed's class, keeps its identity", WithCode(Transient, ErrClosed), Transient, []error{ErrTransient, ErrClosed}, []error{ErrPermanent}},
		{"join: first class in traversal order", errors.Join(io.EOF, ErrNotFound, WithCode(Permanent, io.EOF)), NotFound, []error{ErrNotFound, ErrPermanent}, []error{ErrTransient}},
		{"WithCode(OK) is Unknown", WithCode(OK, ErrNotFound), Unknown, nil, []error{ErrTransient, ErrPermanent, ErrNotFound}},
		{"WithCode(Canceled) matches context.Canceled", WithCode(Canceled, io.EOF), Canceled, []error{context.Canceled}, []error{ErrTransient, ErrPermanent, ErrNotFound}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Code(tt.err); got != tt.want {
				t.Errorf("Code(%v) = %v, want %v", tt.err, got, tt.want)
			}
			for _, target := range tt.is {
				if !errors.Is(tt.err, target) {
					t.Errorf("errors.Is(%v, %v) = false, want true", tt.err, target)
				}
			}
			for _, target := range tt.not {
				if errors.Is(tt.err, target) {
					t.Errorf("errors.Is(%v, %v) = true, want false", tt.err, target)
				}
			}
		})
	}
}

func TestWithCodeNil(t *testing.T) {
	t.Parallel()
	if WithCode(Permanent, nil) != nil {
		t.Fatal("WithCode(nil) must be nil")
	}
	if FromContext(nil) != nil {
		t.Fatal("FromContext(nil) must be nil")
	}
}

func TestErrorMessageKept(t *testing.T) {
	t.Parallel()
	err := WithCode(Transient, WithCode(Permanent, errors.New("pool full")))
	if err.Error() != "pool full" {
		t.Fatalf("message = %q", err.Error())
	}
}

func TestRetryable(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{WithCode(Transient, io.EOF), true},
		{WithCode(Permanent, io.EOF), false},
		{WithCode(NotFound, io.EOF), false},
		{context.Canceled, false},
		{context.DeadlineExceeded, true},
		{io.EOF, true},
	} {
		if got := Retryable(tt.err); got != tt.want {
			t.Errorf("Retryable(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

func TestCodeString(t *testing.T) {
	t.Parallel()
	if NotFound.String() != "NotFound" || ErrorCode(99).String() != "ErrorCode(99)" {
		t.Fatal("String")
	}
}
