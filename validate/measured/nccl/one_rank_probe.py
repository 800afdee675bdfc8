import os,sys,re,json
O,c=sys.argv[1],sys.argv[2];L=f"{O}/nccl{c}.log"
os.environ.update(MASTER_ADDR="127.0.0.1",MASTER_PORT=str(29500+int(c)),NCCL_DEBUG="INFO",NCCL_DEBUG_SUBSYS="INIT,ALLOC",NCCL_DEBUG_FILE=L,NCCL_CUMEM_ENABLE=c)
import torch,torch.distributed as d
torch.cuda.set_device(0);x=torch.ones(1<<20,device="cuda");s=torch.cuda.synchronize;m=lambda:torch.cuda.mem_get_info()[0]
s();f0=m();d.init_process_group("nccl",rank=0,world_size=1);s();f1=m();d.all_reduce(x);s();f2=m();d.all_reduce(x);s();f3=m()
g={}
try:
 from cuda.bindings import driver as D
 D.cuInit(0);p=D.CUmemAllocationProp();p.type=D.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED;p.location.type=D.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE;p.location.id=0
 for n in("MINIMUM","RECOMMENDED"):g[n]=int(D.cuMemGetAllocationGranularity(p,getattr(D.CUmemAllocationGranularity_flags,"CU_MEM_ALLOC_GRANULARITY_"+n))[1])
 g["mc"]=int(D.cuDeviceGetAttribute(D.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,D.cuDeviceGet(0)[1])[1])
except Exception as e:g["err"]=str(e)
d.destroy_process_group();t=open(L).read()
a=[int(v) for v in re.findall(r"Alloc Size (\d+)",t)]
print(json.dumps(dict(nccl=torch.cuda.nccl.version(),cumem=c,gran=g,init=f0-f1,first=f1-f2,second=f2-f3,n=len(a),sum=sum(a),sizes=sorted(set(a)),ch=re.findall(r"\d+ coll channels.*",t)[:1])))
