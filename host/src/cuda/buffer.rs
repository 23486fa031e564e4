//! Typed device memory: an owned buffer ([`DevBuf`]) and typed views into device memory
//! ([`DevPtr`]) that the kernel launchers take instead of raw addresses. A view knows its
//! element type and length; offsets into it are checked.

use super::error::{CudaError, DriverContext};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use std::marker::PhantomData;
use std::sync::Arc;

/// bf16 values as their bits (kernels read them as `bf16_t`).
pub type Bf16 = u16;

/// Weights as stored on the GPU: f32 or bf16 bits, per the executor's dtype (the kernels of
/// that dtype read them).
#[derive(Clone, Copy, Debug)]
pub enum Stored {}

/// KV-cache elements: f32, or fp16 bits with bf16 weights (the kernels of the executor's dtype
/// read them; see `KvOf` in `kernels/common.cuh`).
#[derive(Clone, Copy, Debug)]
pub enum Cached {}

/// `len` elements of `T` at device address `addr`. Plain data: the allocation it points into
/// must outlive every launch that uses it (the session or executor owns it).
pub struct DevPtr<T> {
    addr: u64,
    len: usize,
    _element: PhantomData<fn() -> T>,
}

impl<T> Clone for DevPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevPtr<T> {}

impl<T> std::fmt::Debug for DevPtr<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevPtr({:#x}, {})", self.addr, self.len)
    }
}

impl<T> DevPtr<T> {
    pub(crate) fn new(addr: u64, len: usize) -> Self {
        Self {
            addr,
            len,
            _element: PhantomData,
        }
    }

    /// The device address, as a kernel argument.
    pub fn addr(self) -> u64 {
        self.addr
    }

    pub fn len(self) -> usize {
        self.len
    }

    pub fn is_empty(self) -> bool {
        self.len == 0
    }

    /// The view from element `offset` on, `element_bytes` bytes each (empty past the end:
    /// the launchers then refuse it as too small).
    fn skip_bytes(self, offset: usize, element_bytes: usize) -> Self {
        let offset = offset.min(self.len);
        Self::new(
            self.addr + (offset * element_bytes) as u64,
            self.len - offset,
        )
    }
}

impl<T: DeviceRepr> DevPtr<T> {
    /// The view from element `offset` on.
    pub fn skip(self, offset: usize) -> Self {
        self.skip_bytes(offset, std::mem::size_of::<T>())
    }

    /// The same bytes as KV-cache elements of `element_bytes` each.
    #[cfg(feature = "dev")]
    pub fn as_cached(self, element_bytes: usize) -> DevPtr<Cached> {
        let bytes = self.len * std::mem::size_of::<T>();
        DevPtr::new(self.addr, bytes / element_bytes.max(1))
    }

    /// The same bytes as elements of another type.
    pub fn cast<U: DeviceRepr>(self) -> DevPtr<U> {
        let bytes = self.len * std::mem::size_of::<T>();
        DevPtr::new(self.addr, bytes / std::mem::size_of::<U>())
    }
}

/// An activation or GEMM operand: f32, or bf16 (the fused bf16 prefill's products read and
/// write bf16 rows).
#[derive(Clone, Copy, Debug)]
pub enum Act {
    F32(DevPtr<f32>),
    Bf16(DevPtr<Bf16>),
}

impl Act {
    pub fn addr(self) -> u64 {
        match self {
            Act::F32(p) => p.addr(),
            Act::Bf16(p) => p.addr(),
        }
    }
    pub fn is_bf16(self) -> bool {
        matches!(self, Act::Bf16(_))
    }
}

/// An owned device allocation of `len` elements of `T`, with its address.
pub struct DevBuf<T: DeviceRepr> {
    slice: CudaSlice<T>,
    addr: u64,
}

impl<T: DeviceRepr + ValidAsZeroBits> DevBuf<T> {
    /// `len` zeroed elements (at least one) on `stream`; `what` names it in errors.
    pub fn zeros(
        stream: &Arc<CudaStream>,
        len: usize,
        what: &'static str,
    ) -> Result<Self, CudaError> {
        let slice = stream.alloc_zeros::<T>(len.max(1)).ctx(what)?;
        let addr = slice.device_ptr(stream).0;
        Ok(Self { slice, addr })
    }
}

impl<T: DeviceRepr> DevBuf<T> {
    /// A copy of `values` on the device.
    pub fn from_host(
        stream: &Arc<CudaStream>,
        values: &[T],
        what: &'static str,
    ) -> Result<Self, CudaError> {
        let slice = stream.clone_htod(values).ctx(what)?;
        let addr = slice.device_ptr(stream).0;
        Ok(Self { slice, addr })
    }

    /// The whole buffer as a view.
    pub fn ptr(&self) -> DevPtr<T> {
        DevPtr::new(self.addr, self.slice.len())
    }

    pub fn len(&self) -> usize {
        self.slice.len()
    }

    #[cfg(feature = "dev")]
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// Copy `values` to the buffer's first elements (stream-ordered).
    pub fn write(
        &mut self,
        stream: &Arc<CudaStream>,
        at: usize,
        values: &[T],
    ) -> Result<(), CudaError> {
        let mut dst = self.slice.slice_mut(at..at + values.len());
        stream
            .memcpy_htod(values, &mut dst)
            .ctx("copy to the device")
    }

    /// The first `count` elements, copied back once the stream reaches this point.
    pub fn read(&self, stream: &Arc<CudaStream>, count: usize) -> Result<Vec<T>, CudaError>
    where
        T: Default + Clone,
    {
        let mut out = vec![T::default(); count];
        stream
            .memcpy_dtoh(&self.slice.slice(0..count), &mut out)
            .ctx("copy from the device")?;
        stream.synchronize().ctx("copy from the device")?;
        Ok(out)
    }

    /// Set every element to zero bits (stream-ordered).
    #[cfg(feature = "dev")]
    pub fn clear(&mut self, stream: &Arc<CudaStream>) -> Result<(), CudaError>
    where
        T: ValidAsZeroBits,
    {
        stream.memset_zeros(&mut self.slice).ctx("clear")
    }
}

/// A page-locked host buffer that a device buffer's first elements are copied into without
/// the host waiting (stream-ordered), and the event that marks the copy done: the results
/// of one batched pass, read while the stream already runs the next.
pub struct HostCopy<T: DeviceRepr> {
    host: PinnedHostSlice<T>,
    done: Arc<CudaEvent>,
    count: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits + Copy> HostCopy<T> {
    /// Room for `len` elements (zeroed).
    pub fn new(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CudaError> {
        let ctx = stream.context();
        // SAFETY: the memory is zeroed below before anything reads it.
        let mut host = unsafe { ctx.alloc_pinned_with_flags::<T>(len.max(1), 0) }
            .ctx("page-locked host memory")?;
        let ptr = host.as_mut_ptr().ctx("page-locked host memory")?;
        // SAFETY: `ptr` holds `len.max(1)` elements of T, for which zero bits are valid.
        unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
        let done = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .ctx("an event")?
            .into();
        Ok(Self {
            host,
            done,
            count: 0,
        })
    }

    /// Queue the copy of `src`'s first `count` elements on `stream` (the host does not wait).
    pub fn start(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &DevBuf<T>,
        count: usize,
    ) -> Result<(), CudaError> {
        if count > self.host.len() || count > src.len() {
            return Err(CudaError::Bounds("copy from the device"));
        }
        stream
            .memcpy_dtoh(&src.slice.slice(0..count), &mut self.host)
            .ctx("copy from the device")?;
        self.done.record(stream).ctx("copy from the device")?;
        self.count = count;
        Ok(())
    }

    /// The event that marks the last copy done, to wait on without this buffer (the copy
    /// may be queued again meanwhile: the event then marks the later copy, which ends after).
    pub fn done(&self) -> Arc<CudaEvent> {
        Arc::clone(&self.done)
    }

    /// The elements of the last copy, once it is done (waits for it, yielding the core).
    ///
    /// With one CUDA context in the process the driver's own wait spins on its core. Many
    /// guests read their logits at once under load, more of them than there are cores, and
    /// spinning waiters would take the cores the guests' sampling needs: this wait polls the
    /// event and yields between polls, which costs a lone waiter nothing when a core is free.
    pub fn wait(&self) -> Result<Vec<T>, CudaError> {
        self.done
            .context()
            .bind_to_thread()
            .ctx("copy from the device")?;
        while !self.done.try_is_complete().ctx("copy from the device")? {
            std::thread::yield_now();
        }
        let all = self.host.as_slice().ctx("copy from the device")?;
        Ok(all[..self.count.min(all.len())].to_vec())
    }
}
