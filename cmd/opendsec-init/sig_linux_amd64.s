//go:build linux && amd64 && !opendsec_signotify

#include "textflag.h"

// sigHandler is init's signal handler (see sig_handler_linux.go); the
// kernel calls it with DI the signal, SI its siginfo, DX the ucontext, on
// the thread's alternate signal stack (SA_ONSTACK), every signal blocked.
// A signal in chainMask raised by the kernel (si_code > 0: a fault of init
// itself) goes on to the Go runtime's handler, registers untouched. Any
// other sets its bit in sigPending and writes 1 to the eventfd sigWakeFD
// (non-blocking: a full counter already means a wake-up is due). The kernel
// restores every register on return.
TEXT ·sigHandler(SB),NOSPLIT|NOFRAME,$0
	MOVQ	DI, CX
	MOVQ	$1, AX
	SHLQ	CX, AX
	MOVQ	·chainMask(SB), BX
	TESTQ	AX, BX
	JZ	record
	MOVL	8(SI), BX	// si_code
	CMPL	BX, $0
	JLE	record
	LEAQ	·sigChain(SB), BX
	MOVQ	(BX)(DI*8), BX
	JMP	BX
record:
	LOCK
	ORQ	AX, ·sigPending(SB)
	MOVQ	·sigWakeFD(SB), DI
	LEAQ	·sigOne(SB), SI
	MOVQ	$8, DX
	MOVQ	$1, AX	// write
	SYSCALL
	RET

// sigReturn is the handler's sa_restorer.
TEXT ·sigReturn(SB),NOSPLIT|NOFRAME,$0
	MOVQ	$15, AX	// rt_sigreturn
	SYSCALL
	INT	$3

// func sigAddrs() (handler, restorer uintptr)
TEXT ·sigAddrs(SB),NOSPLIT,$0-16
	LEAQ	·sigHandler(SB), AX
	MOVQ	AX, handler+0(FP)
	LEAQ	·sigReturn(SB), AX
	MOVQ	AX, restorer+8(FP)
	RET
